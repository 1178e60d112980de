"""A torchvision model's grouped convolutions (groups > 1, not depthwise): nnkernels against cuDNN per layer,
forward and backward (dx + dw), NCHW and channels-last, in CUDA-graph replay with default tuning, as
`nnkernels bench model-convs` times them (`time_layer`), then the totals over the layers, each counted once.

    PYTHONPATH=. python tools/grouped_convs.py [MODEL] [PRECISIONS]   # GPU; resnext50_32x4d bf16,tf32 by default
"""
import sys

from nnkernels.bench.model_convs import LAYOUTS, model_shapes, time_layer


def grouped_layers(shapes):
    """The grouped, not depthwise, layers of `shapes` (ConvShapes), in order."""
    return [s for s in shapes if s.groups > 1 and not s.groups == s.x_shape[1] == s.w_shape[0]]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    model = argv[0] if argv else "resnext50_32x4d"
    precisions = argv[1].split(",") if len(argv) > 1 else ["bf16", "tf32"]
    shapes = grouped_layers(model_shapes(model))
    print("| precision | layout | layer | fwd ours / cuDNN µs | x | bwd ours / cuDNN µs | x |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    totals = {}
    for precision in precisions:
        for layout in LAYOUTS:
            for shape in shapes:
                timed = time_layer(shape, precision, layout)
                cells = []
                for direction in ("forward", "backward"):
                    ours, theirs = timed["ours", direction], timed["torch", direction]
                    total = totals.setdefault((precision, layout, direction), [0.0, 0.0])
                    total[0], total[1] = total[0] + ours, total[1] + theirs
                    cells += [f"{ours * 1e3:.1f} / {theirs * 1e3:.1f}", f"{theirs / ours:.2f}x"]
                print(f"| {precision} | {layout} | {shape.name} | " + " | ".join(cells) + " |", flush=True)
    for (precision, layout, direction), (ours, theirs) in totals.items():
        print(f"total {precision} {layout} {direction}: ours {ours:.3f} ms, cuDNN {theirs:.3f} ms, {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
