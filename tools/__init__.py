"""Tools beside the core: what measures or shows a run, never what a run needs.

    bench_extract.py    `make bench-extract`: the extraction stage on the CPU with a small model (views, loader,
                        every method's adapt cost, ECALP's growth)
    bench_methods.py    the method lines of bench_extract (every registered method through the runner)
    bench_gpu.py        `make bench-gpu`: extraction against the image encoder's ceiling on a CUDA GPU; its JSON
                        prices `zaec-sweep --dry-run --rates`
    check_shortcuts.py  a TPT-family method with and without its execution-only shortcuts
    bench_calibrate.py  `make bench`: the CPU stage (the ZAEC solver, zaec-calibrate's time and memory)
    demo/               `make demo`: the whole pipeline on small CLIP-architecture models trained on Fashion-MNIST
    demo_synthetic.py   the CPU stage alone on synthetic shards

They import the core (`extract`, `calibrate`, `schemas`) and the core never imports them
(tests/test_import_layers.py), the way timm keeps `benchmark.py` and `validate.py` beside its library. The package is
not installed with the distribution (a top-level `tools` in site-packages would collide with anyone's): run them from
a checkout, `python -m tools.demo`, `python -m tools.bench_gpu`, or with the checkout on PYTHONPATH.
"""
