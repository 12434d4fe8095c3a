"""A character-level tokenizer and tiny Llama models built offline, for tests and the quickstart;
and how a run finds its model (`prepare_model`) and loads its tokenizers (`load_tokenizer`, a
teacher's checked against the student's).

No hub access at run time: everything here is constructed in-process and saved as a normal HF
directory (config.json, model.safetensors, tokenizer.json), which DeepSpeed roles, HF and vLLM load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from verl_ds.dist import barrier, rank
from verl_ds.errors import ConfigError

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*=# ")


def build_char_tokenizer():
    """One token per character: specials, digits, a few operators. Left padding (for generation)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "12", not "1 2": decode and encode round-trip (multi-turn's check)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer():
    """One token per printable ASCII character (and newline) plus ChatML's `<|im_start|>` and
    `<|im_end|>` (eos), with a ChatML chat template that has a tools section: the tests' stand-in
    for an instruct model's tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters back to the text, no spaces between them
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
        additional_special_tokens=["<|im_start|>"],
    )


def build_tiny_llama(
    out_dir: str | Path,
    tokenizer=None,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 256,
    seed: int = 0,
    max_len: int = 256,
) -> Path:
    """Random-init LlamaForCausalLM with tied embeddings, saved with its tokenizer to `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or build_char_tokenizer()
    cfg = LlamaConfig(**llama_config(tokenizer, hidden, layers, heads, ffn, max_len), torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def llama_config(tokenizer, hidden: int, layers: int, heads: int, ffn: int, max_len: int) -> dict:
    """The HF config of a tiny Llama (`build_tiny_llama`), known before one is built."""
    return dict(
        model_type="llama",
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_tokenizer(t):
    """The tokenizer a `model.tiny` model is built with."""
    return build_chat_tokenizer() if t.tokenizer == "chat" else build_char_tokenizer()


def model_config(model_cfg) -> dict | None:
    """The policy model's HF config (its text part): its config.json, or the one `model.tiny` builds;
    None where the directory is not here (`config render` on another machine)."""
    if model_cfg.path == "tiny":
        t = model_cfg.tiny
        return llama_config(tiny_tokenizer(t), t.hidden, t.layers, t.heads, t.ffn, t.max_positions)
    path = Path(model_cfg.path) / "config.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    return c.get("text_config", c)


def student_tokenizer(model_cfg):
    """The policy's tokenizer (`model.tokenizer_path`, else the model's, else the tiny model's), None
    where its directory is not here."""
    path = model_cfg.tokenizer_path or (None if model_cfg.path == "tiny" else model_cfg.path)
    if path is None:
        return tiny_tokenizer(model_cfg.tiny)
    return load_tokenizer(path, model_cfg.trust_remote_code) if Path(path).is_dir() else None


def prepare_model(model_cfg, run_dir: str | Path) -> str:
    """`model.path`; `tiny` builds a random-init char-level Llama (`model.tiny`) once, under the run
    dir: rank 0 builds it, every rank waits for it."""
    if model_cfg.path != "tiny":
        return model_cfg.path
    out = Path(run_dir) / "init_model"
    t = model_cfg.tiny
    asked = {k: getattr(t, k) for k in TINY_KEYS}
    built = _built_with(out)
    built = built and {"max_positions": 256, **built}  # built before that setting: with its default
    rebuild = built is not None and any(built.get(k, asked[k]) != v for k, v in asked.items())
    if rebuild:
        diff = ", ".join(f"{k} {built[k]} -> {v}" for k, v in asked.items() if k in built and built[k] != v)
        if any((Path(run_dir) / "checkpoints").glob("step_*")):  # a model that trained is the run's model
            raise ConfigError(
                "model.tiny",
                f"{out} was built with other settings ({diff}) and {run_dir}/checkpoints holds its training: "
                "use another trainer.run_dir, or the settings it was built with",
            )
        log.info("model.tiny changed (%s) and nothing trained yet: %s is built again", diff, out)
    barrier()  # every rank has read the old settings before rank 0 replaces them
    if rank() == 0 and (rebuild or built is None):
        shutil.rmtree(out, ignore_errors=True)
        tokenizer = tiny_tokenizer(t)
        shape = dict(hidden=t.hidden, layers=t.layers, heads=t.heads, ffn=t.ffn)
        build_tiny_llama(out, tokenizer, **shape, seed=t.seed, max_len=t.max_positions)
        (out / TINY_FILE).write_text(json.dumps(asked))
    barrier()
    return str(out)


TINY_KEYS = ("tokenizer", "hidden", "layers", "heads", "ffn", "seed", "max_positions")
TINY_FILE = "verl_ds_tiny.json"  # the `model.tiny` settings an init_model was built with


def _built_with(out: Path) -> dict | None:
    """The `model.tiny` settings `out` was built with (from its record, or for a model built before the
    record existed, what its config.json tells); None: nothing built there yet."""
    if not (out / "config.json").exists():
        return None
    try:
        return json.loads((out / TINY_FILE).read_text())
    except (OSError, ValueError):
        c = json.loads((out / "config.json").read_text())
        return {"hidden": c["hidden_size"], "layers": c["num_hidden_layers"], "heads": c["num_attention_heads"],
                "ffn": c["intermediate_size"]}  # fmt: skip


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load a saved tokenizer, keeping a char tokenizer's pre-tokenizer intact (AutoTokenizer on a
    qwen2/llama config replaces a saved pre-tokenizer)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    if (p / "tokenizer.json").exists() and not (p / "tokenizer.model").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
    else:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_teacher_tokenizer(student, teacher: str | Path, trust_remote_code: bool = False) -> None:
    """Distillation compares the two models' logprobs of the same token ids, so every id must name
    the same token in both vocabularies (a smaller or larger model of one family shares them).
    `student`: the policy's tokenizer (`student_tokenizer`); `teacher`: the directory of the teacher's."""
    vocabs = (tok.get_vocab() for tok in (student, load_tokenizer(teacher, trust_remote_code)))
    s_vocab, t_vocab = ({i: tok for tok, i in v.items()} for v in vocabs)
    for i in sorted(set(s_vocab) | set(t_vocab)):
        a, b = s_vocab.get(i), t_vocab.get(i)
        if a != b:
            raise ConfigError(
                "model.teacher_path",
                f"the teacher's tokenizer differs from the student's at id {i} (student {a!r}, teacher {b!r}): "
                "distillation needs the same token ids",
            )
