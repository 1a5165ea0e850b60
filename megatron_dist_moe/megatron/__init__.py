"""Megatron-Core plugin: `moe_token_dispatcher_type='dist_moe'` runs MoE layers on Dist-MoE.

Activation (one step, before Megatron parses its arguments or builds the model):

    import megatron_dist_moe.megatron as dmm
    dmm.install()        # idempotent; dmm.uninstall() restores Megatron

or launch an unmodified Megatron-LM script through the launcher (one process per GPU, as
Megatron runs; docs/megatron.md has the full command lines):

    torchrun --nproc-per-node 8 -m megatron_dist_moe.megatron.launch \
        $MEGATRON_LM_DIR/pretrain_gpt.py --moe-token-dispatcher-type dist_moe ...

Then `--moe-token-dispatcher-type dist_moe` (or `moe_token_dispatcher_type: dist_moe` in a YAML
model config) builds DistMoELayer for every MoE layer. Without install(), layer specs from
`megatron_dist_moe.megatron.spec` build DistMoELayer explicitly (the pipeline slot hooks then
need install() or an explicit `SlotHooks`).

Importing this package does not import Megatron; install() and the submodules layer, spec,
runtime do.
"""

from __future__ import annotations

__all__ = ["install", "uninstall", "is_installed", "DISPATCHER_TYPE"]

DISPATCHER_TYPE = "dist_moe"


def install(options=None) -> None:
    """Let Megatron accept moe_token_dispatcher_type='dist_moe' (see patches.py for what and why).

    options: optional config_map.DistMoEOptions used by every dist_moe layer built afterwards
             (default: Megatron-LM's --dist-moe-* flags, else built-in defaults).
    """
    from .patches import install as _install

    _install(options)


def uninstall() -> None:
    """Undo install() and close the plugin's Dist-MoE contexts."""
    from .patches import uninstall as _uninstall

    _uninstall()


def is_installed() -> bool:
    import sys

    patches = sys.modules.get(__name__ + ".patches")
    return bool(patches is not None and patches.is_installed())
