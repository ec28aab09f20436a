"""The embedded demo: the whole pipeline on small CLIP-architecture models trained by this project on Fashion-MNIST.

``python -m tools.demo --fmnist-dir DIR`` (``make demo``) trains two small open_clip models (a ViT and a
ModifiedResNet image tower, stand-ins for ViT-B-16 and RN50; not OpenAI CLIP), writes Fashion-MNIST's test split clean
and under five shifts as registered datasets, runs every registered TTA method through ``zaec-extract``'s runner,
calibrates with ``zaec-calibrate`` (none, temperature scaling fitted on the clean set, SaLS, ZAEC), builds the paper's
tables with ``zaec-calibrate tables``, and prints a plain-language summary of what the numbers show.

Modules: ``fmnist`` (idx reader), ``images`` (28x28 grey -> 32x32 RGB), ``train`` (contrastive training, saved in
open_clip's ``local-dir:`` format), ``shifts`` (the six sets on disk), ``ood`` (the out-of-distribution pair),
``verdict`` (the sentences comparing raw and ZAEC), ``run`` (orchestration and summary: ``run_demo``, ``DemoConfig``).
"""
