"""The Engine API other trainers embed, in parts: the facade (api: Engine, its lock and public
calls), the set-up (setup: plan, backend, arenas, weights), the training step (steps: StepResult)
and state in and out (state_io: BlockRef, state dicts, blocks). Importing it loads the engine;
nothing here decides placement."""

from dataflow.engine.api import Engine
from dataflow.engine.setup import MOE_NO_OPS, default_profile, refuse_moe_backend
from dataflow.engine.state_io import BLOCK_PARTS, BlockRef
from dataflow.engine.steps import CONFIGURED, StepResult
from dataflow.engine_options import EngineOptions, RunOptions

__all__ = ["BLOCK_PARTS", "CONFIGURED", "MOE_NO_OPS", "BlockRef", "Engine", "EngineOptions",
           "RunOptions", "StepResult", "default_profile", "refuse_moe_backend"]
