"""megatron_dist_moe: distributed routed-expert MLPs over peer-addressable GPU memory.

Importing this package touches no GPU and no process group.

    import megatron_dist_moe as dm
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                    num_experts=E)
    plan = dm.plan_memory(cfg, ep_size=EP); print(plan.explain())
    ctx = dm.create_context(group=ep_group, config=cfg, device=device)   # collective
    y_TD = dm.routed_experts(x_TD, expert_ids_TK, scores_TK, w13, w2, ctx)
"""

from .config import ACTIVATIONS, BACKENDS, PIPELINES, PRECISIONS, WGRAD_DTYPES, Config, load_config
from .context import Context, create_context
from .errors import ConfigError, RoutedExpertsInputError
from .execution import RUNS, Execution
from .memory_plan import MemoryPlan, plan_memory
from .ops import routed_experts
from .prepared import PreparedExperts, PreparedWeight, prepare_expert_weights

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "Config",
    "ConfigError",
    "Context",
    "Execution",
    "MemoryPlan",
    "PIPELINES",
    "PRECISIONS",
    "PreparedExperts",
    "PreparedWeight",
    "RUNS",
    "RoutedExpertsInputError",
    "WGRAD_DTYPES",
    "create_context",
    "load_config",
    "plan_memory",
    "prepare_expert_weights",
    "routed_experts",
]

__version__ = "0.1.0"
