#!/usr/bin/env bash
# The whole boxwarden lifecycle on the local profile (`make demo`): up → run two cells → watch →
# pull → verify → down --dry-run (allowed) → a tampered copy (refused, with its reason) → down.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN="$REPO/.venv/bin"
DEMO="${BOXWARDEN_DEMO_DIR:-$REPO/.demo}"   # tests/test_demo.py runs it in a tmp dir
export BOXWARDEN_HOME="$DEMO/home"   # the demo's own controller state, apart from yours
export COLUMNS="${COLUMNS:-160}"

step() { printf '\n\033[1;36m== %s\033[0m\n' "$*" >&2; }
bw() { printf '\033[2m$ boxwarden %s\033[0m\n' "$*" >&2; "$BIN/boxwarden" "$@"; }
running_jobs() {
  "$BIN/boxwarden" status demo --json | "$BIN/python" -c \
    'import json,sys; print(json.load(sys.stdin)["boxes"][0]["jobs_running"])'   # status schema 2
}

if [ -f "$DEMO/home/boxes/demo/sidecar/sidecar.pid" ]; then   # a previous demo left its sidecar running
  old=$(cat "$DEMO/home/boxes/demo/sidecar/sidecar.pid")
  kill "$old" 2>/dev/null || true
  # Its end, before its dirs go: a sidecar still draining would take the new one's socket with it.
  for _ in $(seq 1 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
fi
rm -rf "$DEMO"; mkdir -p "$DEMO/work"; cd "$DEMO/work"

step "1. up: start the sidecar for box 'demo' (watch ./ckpt, durable copies in the box's own dir)"
bw up demo --profile local --workdir . --watch ckpt --roster cell-a --roster cell-b

step "2. run: two cells of a tiny CPU training, each checkpointing atomically every 50 steps"
seed=0
for cell in cell-a cell-b; do
  seed=$((seed + 1))
  bw run demo --cell "$cell" -- "$BIN/python" "$REPO/examples/train_tiny.py" \
      --out "ckpt/$cell" --steps 200 --save-every 50 --seed "$seed" --step-delay-s 0.01
done

step "3. watch: status while the jobs run"
for _ in $(seq 1 120); do
  bw status demo
  [ "$(running_jobs)" = "0" ] && break
  sleep 1
done
bw logs demo | tail -n 3

step "4. artifacts: every checkpoint sealed, hashed, pushed and proven durable"
for _ in $(seq 1 60); do   # the last saves settle within a second
  "$BIN/boxwarden" artifacts demo --json | "$BIN/python" -c \
    'import json,sys; a=json.load(sys.stdin); c=a.get("claims",[]); sys.exit(0 if c and all(x.get("durable") for x in c) and not a.get("pending") else 1)' \
    && break
  sleep 0.5
done
bw artifacts demo

step "5. pull: bring every claim home, hashed on receipt"
bw pull demo --to pulled

step "6. verify: exact file set, sizes, blake3, load probe (weights_only) → PULL_VERIFIED.json"
bw verify pulled

step "7. down --dry-run: the evidence table and the verdict"
bw down demo --dry-run

step "8. a tampered copy: one flipped byte in a pulled checkpoint must be refused"
cp -a pulled tampered
"$BIN/python" - <<'PY'
from pathlib import Path
f = Path("tampered/cell-a/best.pt"); b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 1; f.write_bytes(bytes(b))
PY
set +e
bw down demo --dry-run --pulled tampered
code=$?
set -e
if [ "$code" -ne 3 ]; then echo "expected the gate to refuse (exit 3), got $code" >&2; exit 1; fi
echo "(refused with exit 3, as it must be)" >&2

step "9. down --confirm demo: delete the verified box-side copies, stop the sidecar"
bw down demo --confirm demo
bw status demo
step "done: pulled tree in $DEMO/work/pulled, durable copies in $DEMO/home/boxes/demo/durable"
