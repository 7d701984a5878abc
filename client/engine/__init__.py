"""kvpool.engine: continuous batching over transformers models whose KV cache lives in kvpool.

    import kvpool.engine as ke
    engine = ke.Engine.connect(model, socket, name="worker", model_id="llama", tokenizer=tok).start()
    stream = engine.add_request("Hello", ke.SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    for out in stream:          # RequestOutput updates as tokens are made
        print(out.new_text, end="")
    engine.close()

Requests join the running batch at the next step; prompts are prefilled in
chunks beside the decodes under a token budget per step; when the pool runs
out, the newest running requests are swapped to the daemon's host tier (or
freed and recomputed without one) and resumed oldest first.  On a GPU,
decode steps replay CUDA graphs captured per batch-size bucket.
"""

from .engine import Engine
from .graphs import GraphRunner, graph_batch_sizes
from .params import EngineConfig, SamplingParams
from .request import RequestOutput
from .runner import StepItem, StepRunner
from .stats import EngineStats
from .stream import RequestStream
from .timings import StepTimings

__all__ = ["Engine", "EngineConfig", "EngineStats", "GraphRunner", "RequestOutput", "RequestStream",
           "SamplingParams", "StepItem", "StepRunner", "StepTimings", "graph_batch_sizes"]
