"""A model process for the multi-engine differential test: one engine per command, on the socket it names.

Reads one JSON command a line on stdin (``{"socket", "scenario", "prefix"}``: a ``Scenario`` as a dict),
plays it with ``differential.run_engine`` and writes one JSON line: each request's tokens, finish reason
and error, and the session's block ceiling.  The model (tests/hf's tiny Llama) loads once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "hf")]

from differential import Req, Scenario, run_engine  # noqa: E402
from hf_models import make_model  # noqa: E402


def scenario_of(d: dict) -> Scenario:
    reqs = tuple(Req(tuple(r["prompt"]), r["max_tokens"], r["arrival"], r["abort_at"]) for r in d["requests"])
    return Scenario(**{**d, "requests": reqs})


def main() -> None:
    model = make_model("llama")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            outputs, max_blocks = run_engine(model, cmd["socket"], scenario_of(cmd["scenario"]),
                                             name=cmd["prefix"], prefix=cmd["prefix"])
            reply = {"max_blocks": max_blocks, "outputs": {
                str(i): {"token_ids": list(o.token_ids), "finish_reason": o.finish_reason, "error": o.error}
                for i, o in outputs.items()}}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"exception": repr(exc)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
