"""Execution: how a context runs, decided once when it is created and shown by explain().

`Execution.resolve(config, device, overrides)` turns a Config (what the user chose: precision,
pipeline, inference, backend, timeouts) and the device into one frozen description that the
backend, its routing, bookkeeping, expert pipeline and kernel launchers receive explicitly.
Nothing below reads the environment at import or call time; this module is the only reader of
the one development override, `DIST_MOE_EXECUTION`.

What runs (`RUNS`): each backend, the precisions it implements and the pipelines of each.
Config refuses anything else when it is built, naming the field, so no entry point accepts a
mode that no backend runs.

Development overrides select the plain-torch twins that the tests and baselines compare against
(they are not user choices, hence not Config fields):

    gemm_engine   "triton" (our grouped GEMMs) | "torch" (torch._grouped_mm with separate
                  gather / SwiGLU / scatter kernels: the GEMM oracle and a baseline)
    routing       "triton" (one or two launches) | "torch" (sort / scatter ops: the routing oracle)
    bookkeeping   "triton" (one launch) | "torch" (the shared planner functions: its oracle)
    fp8_gemm      fp8_block's GEMMs with a CUTLASS unit: the W13 FPROP and (training) the two
                  WGRADs and the two DGRADs (the W13 DGRAD's scatter then a separate launch):
                  "cutlass" (CUTLASS's sm_90a blockwise-scaled grouped kernels, csrc/; the
                  default on a Hopper GPU where their library loads: built on first use,
                  cached) | "triton" (our kernels, the default elsewhere, and on every rank of
                  a group where some rank cannot load the library). The W2 FPROP is Triton
                  (the scatter to the owners in its epilogue) unless fp8_combine is "pull"
    fp8_gather    how fp8_block's and mxfp8's quantizers get x's (backward: grad_y's) rows:
                  "quantizer"
                  (the row quantizer reads each row where it lies, one read per route, no bf16
                  copy; the default at EP = 1, where every row is on this GPU) | "fanout" (the
                  fan-out copy into x_g / g3, each token row read once over NVLink, then the
                  quantizer; the default at EP > 1: the bf16 fan-out measured -0.13 ms per
                  forward against one read per route at EP = 2)
    fp8_combine   where fp8_block's W2 FPROP puts the route outputs: "scatter" (our Triton GEMM
                  stores each row into its owner's combine buffer from its epilogue) | "pull"
                  (the GEMM stores dense rows, on CUTLASS where fp8_gemm says so, and the
                  combine kernel reads each route's row where it lies; the default at EP = 1
                  without save_route_outputs; refused at EP > 1, where the rows would stay on
                  the expert's GPU, and with save_route_outputs, whose backward reads the
                  combine buffer)
    fp8_quant     fp8_block's rows + columns quantizer (x, grad_y) and the backward's SwiGLU
                  pass with its quantizations (grad_h1's rows and columns, h2's columns): "cuda"
                  (csrc/fp8_block_quant.cu: the tile in registers, the transposed column bundle
                  through shared memory, the SwiGLU backward quantizing from registers; the
                  default on a Hopper GPU where its library loads: built on first use in
                  seconds, cached) | "triton" (kernels/quant_fp8.py, the default elsewhere: the
                  quantizer's bits, the SwiGLU pass storing bf16 grad_h1 and h2 for it)
    nvfp4_gemm    nvfp4 inference's GEMMs: "cuda" (our CUDA C++ GEMMs: the decode GEMM up to
                  16 rows per expert, csrc/nvfp4_decode_mm.cu, and the wgmma GEMM above,
                  csrc/nvfp4_wgmma_mm.cu, stream-K up to 160; the default on a Hopper GPU where their library
                  loads: built on first use in seconds, cached) | "triton" (our Triton NVFP4
                  GEMM at every row count)

Pass them to `create_context(..., execution_overrides={"gemm_engine": "torch"})`, or set
`DIST_MOE_EXECUTION="gemm_engine=torch,routing=torch"`; an unknown name or value raises.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["RUNS", "Execution", "runs", "runs_precision", "what_runs", "parse_overrides",
           "OVERRIDES", "ENV_OVERRIDES", "agree_engines"]

# backend -> precision -> the pipelines it runs that precision with (the reference backend runs
# one algorithm for every pipeline)
RUNS: dict[str, dict[str, tuple[str, ...]]] = {
    "reference": {p: ("standard", "staged", "mega")
                  for p in ("bf16", "fp8_block", "mxfp8", "nvfp4")},
    "cuda": {"bf16": ("standard", "staged", "mega"), "fp8_block": ("standard",),
             "mxfp8": ("standard",), "nvfp4": ("standard",)},
}

OVERRIDES: dict[str, tuple[str, ...]] = {
    "gemm_engine": ("triton", "torch"),
    "routing": ("triton", "torch"),
    "bookkeeping": ("triton", "torch"),
    "fp8_gemm": ("cutlass", "triton"),
    "fp8_quant": ("cuda", "triton"),
    "nvfp4_gemm": ("cuda", "triton"),
    "fp8_gather": ("quantizer", "fanout"),
    "fp8_combine": ("pull", "scatter"),
}
ENV_OVERRIDES = "DIST_MOE_EXECUTION"


def runs(backend: str, precision: str, pipeline: str) -> bool:
    return pipeline in RUNS.get(backend, {}).get(precision, ())


def runs_precision(precision: str, backend: str | None = None) -> bool:
    """Whether `backend` (any backend when None) runs `precision` with some pipeline."""
    return any(precision in RUNS[b] for b in ([backend] if backend else RUNS))


def what_runs() -> str:
    """What each backend runs, precision by precision (for error messages)."""
    return "; ".join(f"{b}: " + ", ".join(f"{p!r} ({'/'.join(pipes)})" for p, pipes in r.items())
                     for b, r in RUNS.items())


def parse_overrides(text: str, source: str = ENV_OVERRIDES) -> dict[str, str]:
    """'gemm_engine=torch,routing=torch' -> dict; an unknown name or value raises ValueError."""
    out: dict[str, str] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{source}: {item!r} is not name=value")
        out[name] = value
    return check_overrides(out, source)


def check_overrides(overrides: Mapping[str, Any], source: str) -> dict[str, str]:
    out = {}
    for name, value in overrides.items():
        if name not in OVERRIDES:
            raise ValueError(f"{source}: unknown execution override {name!r}; known: "
                             f"{', '.join(sorted(OVERRIDES))}")
        if value not in OVERRIDES[name]:
            raise ValueError(f"{source}: {name}={value!r}; expected one of "
                             f"{', '.join(OVERRIDES[name])}")
        out[name] = value
    return out


# the engines a context picks by whether a csrc/ library loads: field -> (the library's
# engine, the fallback); each applies to one precision and mode (Execution.__post_init__)
_LIBRARY_ENGINES = {"fp8_gemm": ("cutlass", "triton"), "fp8_quant": ("cuda", "triton"),
                    "nvfp4_gemm": ("cuda", "triton")}


def agree_engines(execution: "Execution", group) -> "Execution":
    """The ranks of `group` run the same engines (collective; Context creation): where some
    rank could not load a csrc/ library, every rank runs the fallback, so all ranks compute the
    same bits and explain() says the same on each."""
    import torch.distributed as dist
    if execution.backend != "cuda":
        return execution
    mine = {f: getattr(execution, f) for f in _LIBRARY_ENGINES}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    changes = {}
    for field, (library, fallback) in _LIBRARY_ENGINES.items():
        if mine[field] == library and any(e[field] != library for e in everyone):
            ranks = [r for r, e in enumerate(everyone) if e[field] != library]
            warnings.warn(f"{field}: every rank runs {fallback!r}: ranks {ranks} cannot load "
                          f"the {library!r} engine's library (csrc/)", stacklevel=3)
            changes[field] = fallback
    return execution.replace(**changes) if changes else execution


@dataclass(frozen=True)
class Execution:
    """How one context runs (frozen; built by `resolve`)."""

    backend: str                 # "reference" | "cuda"
    precision: str
    pipeline: str                # "standard" | "staged" | "mega"
    inference: bool
    save_route_outputs: bool
    wait_timeout_s: float
    gemm_engine: str = "triton"  # cuda backend only; see the module docstring
    routing: str = "triton"
    bookkeeping: str = "triton"
    fp8_gemm: str = "triton"     # fp8_block on the cuda backend; see the module docstring
    fp8_quant: str = "triton"    # likewise
    nvfp4_gemm: str = "triton"   # nvfp4 inference on the cuda backend; see the docstring
    fp8_gather: str = "fanout"   # fp8_block on the cuda backend; see the module docstring
    fp8_combine: str = "scatter"  # likewise

    @classmethod
    def resolve(cls, config, device: torch.device,
                overrides: Mapping[str, str] | None = None,
                cutlass_loads: Callable[[torch.device], bool] | None = None,
                nvfp4_loads: Callable[[torch.device], bool] | None = None,
                fp8_quant_loads: Callable[[torch.device], bool] | None = None,
                ep_size: int = 1) -> "Execution":
        """The execution of `config` on `device`. overrides: see the module docstring; the
        DIST_MOE_EXECUTION variable applies first, explicit overrides on top. cutlass_loads /
        nvfp4_loads / fp8_quant_loads: whether a csrc/ library loads on `device`
        (create_context passes grouped_gemm_sm90.fp8_gemm_loads, grouped_gemm.nvfp4_decode.loads
        and quant_fp8_cuda.loads; without them the engines default to Triton). ep_size: the
        group's ranks (what the gathers read over NVLink)."""
        from .errors import ConfigError

        backend = config.backend
        if backend == "auto":
            capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            backend = "cuda" if capable else "reference"
        elif backend == "cuda" and device.type != "cuda":
            raise ConfigError("backend", f"backend='cuda' needs a CUDA device, got {device}")
        if not runs(backend, config.precision, config.pipeline):
            field = "precision" if not runs_precision(config.precision, backend) else "pipeline"
            raise ConfigError(field, f"the {backend} backend does not run precision="
                              f"{config.precision!r} with pipeline={config.pipeline!r}; what "
                              f"runs: {what_runs()}")
        chosen = parse_overrides(os.environ.get(ENV_OVERRIDES, ""))
        chosen.update(check_overrides(dict(overrides or {}), "execution_overrides"))
        if backend == "reference" and chosen:
            raise ValueError(f"execution overrides {sorted(chosen)} select CUDA-backend twins; "
                             "this context runs the reference backend")
        if backend == "cuda" and config.precision == "fp8_block" and "fp8_gemm" not in chosen:
            cutlass = cutlass_loads is not None and cutlass_loads(device)
            chosen["fp8_gemm"] = "cutlass" if cutlass else "triton"
        if backend == "cuda" and config.precision == "fp8_block" and "fp8_quant" not in chosen:
            cuda = fp8_quant_loads is not None and fp8_quant_loads(device)
            chosen["fp8_quant"] = "cuda" if cuda else "triton"
        if (backend == "cuda" and config.precision in ("fp8_block", "mxfp8")
                and "fp8_gather" not in chosen):
            chosen["fp8_gather"] = "quantizer" if ep_size == 1 else "fanout"
        if chosen.get("fp8_combine") == "pull" and ep_size > 1:
            raise ValueError(f"fp8_combine='pull' runs at EP = 1 only (this group has {ep_size} "
                             "ranks: the owners' route rows would stay on the experts' GPUs)")
        if (backend == "cuda" and config.precision == "fp8_block"
                and "fp8_combine" not in chosen):
            chosen["fp8_combine"] = ("pull" if ep_size == 1 and not config.save_route_outputs
                                     else "scatter")
        if backend == "cuda" and config.precision == "nvfp4" and "nvfp4_gemm" not in chosen:
            cuda = nvfp4_loads is not None and nvfp4_loads(device)
            chosen["nvfp4_gemm"] = "cuda" if cuda else "triton"
        return cls(backend=backend, precision=config.precision, pipeline=config.pipeline,
                   inference=config.inference, save_route_outputs=config.save_route_outputs,
                   wait_timeout_s=float(config.wait_timeout_s), **chosen)

    def __post_init__(self):
        if self.fp8_gemm == "cutlass" and (self.backend != "cuda"
                                           or self.precision != "fp8_block"):
            raise ValueError(f"fp8_gemm='cutlass' is fp8_block's CUDA-backend GEMMs; this "
                             f"context runs precision={self.precision!r} on {self.backend!r}")
        if self.fp8_quant == "cuda" and (self.backend != "cuda" or self.precision != "fp8_block"):
            raise ValueError(f"fp8_quant='cuda' is fp8_block's CUDA-backend quantizer; this "
                             f"context runs precision={self.precision!r} on {self.backend!r}")
        if self.fp8_gather == "quantizer" and (self.backend != "cuda"
                                                 or self.precision not in ("fp8_block", "mxfp8")):
            raise ValueError(f"fp8_gather='quantizer' is fp8_block's and mxfp8's CUDA-backend "
                             f"quantizers; "
                             f"this context runs precision={self.precision!r} on "
                             f"{self.backend!r}")
        if self.fp8_combine == "pull" and (self.backend != "cuda"
                                           or self.precision != "fp8_block"
                                           or self.save_route_outputs):
            raise ValueError(f"fp8_combine='pull' is fp8_block's CUDA-backend combine without "
                             f"save_route_outputs; this context runs precision="
                             f"{self.precision!r} on {self.backend!r}, save_route_outputs="
                             f"{self.save_route_outputs}")
        if self.nvfp4_gemm == "cuda" and (self.backend != "cuda" or self.precision != "nvfp4"):
            raise ValueError(f"nvfp4_gemm='cuda' is nvfp4's CUDA-backend GEMMs; this "
                             f"context runs precision={self.precision!r} on {self.backend!r}")
        if self.gemm_engine == "torch" and self.precision != "bf16":
            raise ValueError(f"gemm_engine='torch' is the bf16 GEMM oracle; precision="
                             f"{self.precision!r} runs our kernels only")
        if self.gemm_engine == "torch" and self.pipeline != "standard":
            raise ValueError(f"gemm_engine='torch' runs the standard pipeline only (pipeline="
                             f"{self.pipeline!r}: the staged claims and the Mega work list "
                             "live inside our GEMMs)")

    def replace(self, **changes) -> "Execution":
        return dataclasses.replace(self, **changes)

    # -- what the choices mean --------------------------------------------------------------
    @property
    def quantizer_gathers(self) -> bool:
        return self.fp8_gather == "quantizer"

    @property
    def x_gather(self) -> str:
        if self.backend == "reference":
            return "all_to_all_single"
        if self.quantizer_gathers:
            return ("inside the quantizer: x's rows (backward: grad_y's) read where they lie "
                    "and quantized, no bf16 copy (EP = 1: every row is on this GPU)")
        if self.pipeline == "staged" and self.gemm_engine == "triton":
            return "claimed inside the W13 GEMM (each m-tile copied once, in column slices)"
        return "fan-out: each token row read once and written to all of its rows"

    @property
    def score_gradients(self) -> str:
        if self.inference:
            return "none (inference)"
        if self.save_route_outputs:
            return "token owner, from the saved route outputs"
        return ("expert side, <W2^T grad_y, h2> per route, summed over tiles in a fixed order"
                if self.backend == "cuda" else "expert side, <W2^T grad_y, h2> per route")

    def explain(self, tiles: str | None = None) -> str:
        """tiles: the GEMM tiles at the context's row bound (kernels/grouped_gemm/choice.py;
        Context.explain passes them)."""
        rows = [("backend", self.backend), ("precision", self.precision),
                ("mode", "inference" if self.inference else "training")]
        if self.backend == "cuda":
            if self.precision == "fp8_block":
                gemms = ("FP8 block-scaled grouped GEMMs (E4M3, 1x128 activation / 128x128 "
                         "weight scales, fp32 promotion every 128 of K): ")
                engine = ("CUTLASS's sm_90a blockwise-scaled ptr-array kernel (csrc/, "
                          "128x128x128 cooperative tiles, promotion overlapped)"
                          if self.fp8_gemm == "cutlass"
                          else "our Triton persistent kernel")
                gemms += f"the W13 FPROP on {engine}, "
                gemms += (f"the W2 FPROP on {engine} storing dense rows, which the combine "
                          "kernel reads where they lie (EP = 1)" if self.fp8_combine == "pull"
                          else "the W2 FPROP on our Triton kernel with the scatter to the "
                          "owners in its epilogue")
            elif self.precision == "mxfp8":
                gemms = ("Triton persistent bf16 grouped GEMMs on the MXFP8 operands' bf16 "
                         "copies (exact: Hopper has no MXFP8 instruction); scatter to the "
                         "owners in the W2 epilogue")
            elif self.precision == "nvfp4":
                triton = ("Triton NVFP4 grouped GEMMs on prepared weights (E2M1 x E4M3 decoded "
                          "into exact fp16 in registers, fp16 MMAs)")
                gemms = ("our CUDA C++ NVFP4 GEMMs, weights as the MMA's M side and each "
                         "thread decoding its fragment's E2M1 values from its own loads: "
                         "mma.sync at a row bound of up to 16 rows per expert "
                         "(csrc/nvfp4_decode_mm.cu), wgmma with the weights from registers "
                         "above (csrc/nvfp4_wgmma_mm.cu; stream-K, the k chunks split evenly "
                         "over the SMs, up to 160 rows per expert)"
                         if self.nvfp4_gemm == "cuda" else triton)
                gemms += ("; the global scales in the epilogue, scatter to the owners in the "
                          "W2 epilogue")
            elif self.gemm_engine == "triton" and self.pipeline == "mega":
                gemms = ("one persistent Triton launch for the forward: programs claim W13 "
                         "tiles (+ SwiGLU), then W2 tiles (+ scatter to the owners) from one "
                         "device work list; an m-tile's W2 tiles start once its h2 is stored")
            elif self.gemm_engine == "triton":
                gemms = ("Triton persistent grouped GEMMs (SwiGLU in the W13 epilogue, scatter "
                         "to the owners in the W2 epilogue)")
            else:
                gemms = ("torch._grouped_mm with separate gather / SwiGLU / scatter kernels "
                         "(oracle)")
            rows += [("pipeline", self.pipeline), ("GEMMs", gemms)]
            if tiles and self.gemm_engine == "triton":
                rows += [("GEMM tiles", tiles)]
            rows += [("x gather", self.x_gather),
                     ("routing tables", "Triton, 1 launch where all ranks' routes fit one "
                      "tile (decode), else 2" if self.routing == "triton"
                      else "torch ops (oracle)"),
                     ("bookkeeping", "Triton, 1 launch" if self.bookkeeping == "triton"
                      else "torch planner functions (oracle)")]
            if self.precision == "fp8_block":
                rows += [("quantization", ("CUDA C++ (csrc/fp8_block_quant.cu)"
                                           if self.fp8_quant == "cuda" else "Triton")
                          + " quantizer: x_g rows (and columns, saved) "
                          + ("read by the quantizer where they lie; " if self.quantizer_gathers
                             else "after the gather; ") +
                          "SwiGLU writes the h2 row bundle (and the saved h1 row bundle); "
                          + ("the backward's SwiGLU pass writes grad_h1's and h2's bundles "
                             "(CUDA C++); " if self.fp8_quant == "cuda" else
                             "the backward's SwiGLU pass writes bf16 grad_h1 and h2, "
                             "quantized after it; ") +
                          "weights by every forward (both orientations), reused by its "
                          "backward, or once per step into the context's weight cache "
                          "(routed_experts(is_first_microbatch=True), reused by False calls)")]
            if self.precision == "mxfp8":
                rows += [("quantization", "x_g " + ("read by the quantizer where its rows lie"
                                                    if self.quantizer_gathers else
                                                    "after the gather") + " (fake rows; training: "
                          "the saved column bundle); SwiGLU writes h2's fake rows (and the "
                          "saved h1 row bundle); backward: g3 and grad_h1 rows and the WGRAD "
                          "operands' columns; weights (32 x 32 tiles) by every forward, reused by its "
                          "backward, or once per step into the context's weight cache "
                          "(routed_experts(is_first_microbatch=True), reused by False calls)")]
            if self.precision == "nvfp4":
                rows += [("quantization", "token rows by their source rank (NVFP4 byte rows in "
                          "the dispatch buffer); W13 stores h1 (bf16), one launch applies the "
                          "SwiGLU and quantizes h2's rows")]
            if not self.inference:
                w2_dgrad = "W2 DGRAD with the SwiGLU backward in its epilogue"
                if self.precision == "fp8_block":
                    w2_dgrad = (f"W2 DGRAD on {'CUTLASS' if self.fp8_gemm == 'cutlass' else 'Triton'}"
                                " storing u = g3 W2, then one SwiGLU-backward pass (grad_h1, h2, "
                                "score parts)")
                w13_dgrad = ("W13 DGRAD on CUTLASS storing dense rows, then one launch "
                             "scattering them to the owners"
                             if self.precision == "fp8_block" and self.fp8_gemm == "cutlass"
                             else "W13 DGRAD scattering to the owners")
                if self.fp8_combine == "pull":
                    w13_dgrad = ("W13 DGRAD storing dense rows, which the route reduction "
                                 "reads where they lie (EP = 1)")
                rows += [("backward", f"{w2_dgrad}, W2 WGRAD, {w13_dgrad}, W13 WGRAD"
                          if self.gemm_engine == "triton" else "torch._grouped_mm")]
                if self.precision == "fp8_block":
                    rows += [("WGRADs", "CUTLASS sm_90a FP8 blockwise-scaled grouped GEMM "
                              "(csrc/, 128x128x128 cooperative tiles, promotion overlapped)"
                              if self.fp8_gemm ==
                              "cutlass" else "Triton FP8 block-scaled grouped WGRAD")]
            rows += [("device waits", f"give up after {self.wait_timeout_s:g} s")]
        else:
            rows += [("kernels", "plain PyTorch over torch.distributed (the oracle)")]
        if not self.inference:
            rows += [("score gradients", self.score_gradients)]
        w = max(len(k) for k, _ in rows)
        return "\n".join(["Dist-MoE execution", "=" * 18] + [f"{k:<{w}}  {v}" for k, v in rows])
