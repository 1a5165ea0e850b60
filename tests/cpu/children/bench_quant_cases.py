"""Child of tests/cpu/test_bench_quant_interp.py: benchmarks/bench_quant.py's cases at small
shapes under Triton's interpreter. Each case runs (the default launch order and tile, and for
mxfp8 `quantize` two explicit tiles, 32 and 128 rows, for fp8_block `quantize_rows_cols` the
looped 32 x 2 tile and the unrolled 64 x 4 one; the launcher's own tile takes one 128-column
chunk in the interpreter) and is checked against its twin the way
the GPU benchmark checks it, after its outputs are poisoned. Prints one `RESULT <json>` each."""
import json

import bench_quant as B

T, K, E, D, F = 40, 2, 4, 256, 128
offs = B.guide_offsets(T, K, E, "cpu")
R = int(offs[-1])
for (prec, name), case in B.cases(R, E, D, F, offs, "cpu").items():
    extra = {"mxfp8": [(32, 32, 1), (128, 32, 8)], "fp8_block": [(32, 2), (64, 4)]}[prec]
    tiles = [None] + (extra if case.takes_tile else [])
    for tile in tiles:
        for t in case.outputs:
            B.poison(t)
        if case.reset is not None:
            case.reset()
        case.launch(None, tile)
        ok = bool(case.check())
        label = "default" if tile is None else "x".join(map(str, tile))
        print("RESULT " + json.dumps(dict(name=f"{prec}:{name}:{label}", equal=ok,
                                          nbytes=case.nbytes)), flush=True)
