"""marft's own endpoint (serve_team: request parsing, tool prompts, <tool_call> parsing, SSE) over the tiny
model, with each reply's text replaced, since a random model writes no tool call: "Let me add." and a Hermes
<tool_call> of add(2, 3) until the chat holds a tool result, then "The answer is 5.". Prints its URL, serves
until killed. Run with marft's venv: python scripted_serve.py MODEL_DIR API_KEY"""
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines import make_engine  # noqa: E402
from marft.engines.generation import Sampling  # noqa: E402
from marft.serving.serve import serve_team  # noqa: E402

CALL = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FINAL = "The answer is 5."


class Scripted:
    """An engine whose replies' text is scripted (the tokens and log-probabilities stay the model's)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, agent, chats, sampling, generator=None):
        out = self.engine.generate(agent, chats, sampling, generator)
        told = [any(m["role"] == "tool" or "<tool_response>" in (m.get("content") or "") for m in c) for c in chats]
        out.texts = [FINAL if t else CALL for t in told]
        return out

    def flops(self, agent, out):
        return 0.0


model_dir, key = sys.argv[1], sys.argv[2]
cfg = load_config(Path(__file__).resolve().parents[2] / "configs/duo_arithmetic.yaml",
                  [f"model.name={model_dir}", "model.dtype=float32", "model.device=cpu", "threads=1"])
team, models, _ = prepare(cfg)
with serve_team(models, team, Scripted(make_engine(cfg, models)), Sampling(temperature=1.0, max_new_tokens=8),
                api_key=key, port=0) as server:
    print("scripted marft endpoint at", server.url, flush=True)
    threading.Event().wait()
