#!/usr/bin/env bash
# Do real agent frameworks run unchanged against marft's OpenAI-compatible endpoint (`marft serve`)?
# Checks, each asserting its outcome: LangChain's ChatOpenAI (invoke, stream, batch, a bind_tools tool loop
# invoked and streamed), LangGraph's ReAct agents (create_react_agent, langchain.agents.create_agent: a
# tool loop through .invoke and .stream(stream_mode="messages")), the OpenAI Agents SDK with
# OpenAIChatCompletionsModel or set_default_openai_api("chat_completions") (a tool loop through
# Runner.run_sync and Runner.run_streamed), and the limits: the Responses API (the SDK's default) gets a
# 404, a forced tool_choice a 400. The tiny random model (tests/conftest.py's build_tiny_model) writes no
# tool call, so the tool loops run against a second endpoint, marft's own server with each reply's text
# scripted (framework_check/scripted_serve.py): a <tool_call> of add(2, 3), then "The answer is 5.".
#   bash scripts/framework_check.sh                   # frameworks in /tmp/marft-frameworks (made if missing)
#   VENV=/path/to/venv bash scripts/framework_check.sh  # reuse a venv (installed into if it lacks them)
# Prints the frameworks' versions and `ok NAME` / `FAIL NAME: why` per check; exit status 1 on any failure.
# Takes 20-30 s on 2 busy CPU cores with the venv made; the first run adds its pip install (about 20 s from
# a local package mirror, longer from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/marft-frameworks}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
KEY=sk-check-$RANDOM$RANDOM
WORK=$(mktemp -d /tmp/marft-framework-check.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! "$VENV/bin/python" -c "import langchain_openai, langgraph, langchain, agents" 2>/dev/null; then
  echo "installing the frameworks into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q langchain-openai langgraph langchain openai-agents
fi

.venv/bin/python -c 'import sys; from pathlib import Path; sys.path.insert(0, "tests")
from conftest import build_tiny_model; build_tiny_model(Path(sys.argv[1]))' "$WORK/tiny-model" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }

MARFT_API_KEY=$KEY .venv/bin/marft serve configs/duo_arithmetic.yaml "model.name=$WORK/tiny-model" \
  model.dtype=float32 model.device=cpu threads=1 --port 0 >"$WORK/real.log" 2>&1 &
PIDS+=($!)
.venv/bin/python scripts/framework_check/scripted_serve.py "$WORK/tiny-model" "$KEY" >"$WORK/scripted.log" 2>&1 &
PIDS+=($!)

wait_url() {  # URL := the address the server prints once it listens (up to 2 minutes)
  local log=$1 pid=$2
  for _ in $(seq 240); do
    URL=$(grep -o 'http://127\.0\.0\.1:[0-9]*/v1' "$log" | head -1 || true)
    [ -n "$URL" ] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "FAIL server start: no URL in $log:" >&2; cat "$log" >&2; exit 1
}
wait_url "$WORK/real.log" "${PIDS[0]}"; REAL=$URL
wait_url "$WORK/scripted.log" "${PIDS[1]}"; SCRIPTED=$URL
echo "marft serve at $REAL, scripted endpoint at $SCRIPTED"

"$VENV/bin/python" scripts/framework_check/checks.py "$REAL" "$SCRIPTED" "$KEY" &
PIDS+=($!)  # waited on in the background, so that a signal stops it and the servers at once
status=0; wait $! || status=$?
echo "framework check: exit status $status in ${SECONDS} s"
exit "$status"
