# Sourced by install.sh and env.sh: tcmalloc_path prints where libtcmalloc_minimal.so.4 is, or nothing.
tcmalloc_path() {
  local d
  for d in "/usr/lib/$(uname -m)-linux-gnu" /usr/lib64 /usr/lib /usr/local/lib; do
    if [ -e "$d/libtcmalloc_minimal.so.4" ]; then echo "$d/libtcmalloc_minimal.so.4"; return; fi
  done
}
