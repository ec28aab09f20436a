"""The data of an out-of-distribution run: one mixed list of the in-distribution set's test images and the OOD
set's images, its identity, and the metadata that marks its shards (docs/contract.md, "Out-of-distribution runs";
docs/extract.md, "Out-of-distribution runs").

The mixed list is indexed by sample id: [0, n_id) are the in-distribution set's test images in its canonical order
(the ids its plain runs give them, so the two pair up), [n_id, n_id + n_ood) the OOD set's images in theirs, labels
the in-distribution labels and `schemas.shard.OOD_LABEL` (-1). The stream over it is the plain rule with the run's dataset
key: `stream_permutation("<ood>@<id>", seed, n_id + n_ood)`, one permutation of the union per (OOD set, in-
distribution set, seed), the same for every method, so in- and out-of-distribution images are interleaved at random
as a deployed model would meet them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from extract.datasets import DatasetError, TestSet, load_ood_images, load_testset, shared_files
from extract.run.options import PlannedRun
from extract.run.rundata import RunData, resolved_root
from schemas.shard import OOD_LABEL


def mixed_testset(id_set: TestSet, ood_set: TestSet, key: str) -> TestSet:
    """The mixed list of an OOD run: `id_set`'s samples, then `ood_set`'s with label -1 (see the module docstring).

    Args:
        id_set: the in-distribution test set (N_id samples, K classes); ood_set: the OOD images (N_ood); each as
            its loader returns it (`load_testset`, `load_ood_images`: no file listed twice in it).
        key: the run's dataset key `<ood>@<id>`.

    Returns:
        TestSet of N_id + N_ood samples with `id_set`'s class names and ImageNet indices; its `dataset_dir` is the
        deepest folder holding both sets (paths in its fingerprint are relative to it).

    Raises:
        DatasetError: image files in both sets (each would be one image with two sample ids and two labels): the
            message says the two sets share their images, how many, and what the OOD set is (`textures` is DTD).

    Example:
        >>> mixed_testset(dtd, inat, "inaturalist@dtd").labels[-1]  # doctest: +SKIP
        -1
    """
    both = shared_files(id_set, ood_set)
    if both:
        raise DatasetError(shared_images_message(id_set, ood_set, both))
    root = Path(os.path.commonpath([id_set.dataset_dir, ood_set.dataset_dir]))
    labels = np.concatenate([id_set.labels, np.full(len(ood_set), OOD_LABEL, np.int64)])
    notes = {**id_set.notes, **{f"ood_{k}": v for k, v in ood_set.notes.items()}}
    return TestSet(key=key, dataset_dir=root, layout=f"{id_set.layout}; out-of-distribution: {ood_set.layout}",
                   paths=id_set.paths + ood_set.paths, labels=labels, class_names=id_set.class_names,
                   imagenet_indices=id_set.imagenet_indices, notes=notes)


def shared_images_message(id_set: TestSet, ood_set: TestSet, both: list[tuple[int, int]]) -> str:
    """The line for an OOD set that holds in-distribution images: the two sets share their images, how many, an
    example, and what the OOD set is (its registry description: `textures` is all of DTD's images)."""
    from extract.datasets import get_dataset

    i, j = both[0]
    what = get_dataset(ood_set.key).description
    return (f"--dataset {ood_set.key!r} and --ood-for {id_set.key!r} share their images: {len(both)} of the "
            f"{len(ood_set)} out-of-distribution images are test images of {id_set.key!r} (e.g. {ood_set.paths[j]}"
            f"{'' if ood_set.paths[j] == id_set.paths[i] else f' = {id_set.paths[i]}'})"
            f"{f'; {ood_set.key}: {what}' if what else ''}; an out-of-distribution set must hold none of the "
            "in-distribution set's images (each would be one image with two labels): choose another --ood-for or "
            "another out-of-distribution set")


def load_mixed_data(planned: PlannedRun) -> RunData:
    """List both sets of an OOD run, mix them and fingerprint every image file (the mixed set's own identity: its
    feature cache and finished-run check cover both sets' files, apart from either set's plain runs).

    Raises:
        DatasetError: either set missing (with its expected layout) or unreadable, a file in both sets.
    """
    from extract.fingerprint import fingerprint

    assert planned.ood_for is not None and planned.ood_dataset is not None
    o = planned.options
    id_set = load_testset(planned.ood_for, o.data_root, sh_filter=o.sh_filter)
    ood_set = load_ood_images(planned.ood_dataset, o.data_root, sh_filter=o.sh_filter)
    mixed = mixed_testset(id_set, ood_set, planned.dataset)
    identity = {"data_root": resolved_root(id_set, o.data_root), "ood_data_root": resolved_root(ood_set, o.data_root),
                "data_fingerprint": fingerprint(mixed, o.fingerprint)}
    return RunData(mixed, identity, n_id=len(id_set), sources=(id_set, ood_set))


def ood_meta(planned: PlannedRun, data: RunData) -> dict[str, str]:
    """The file metadata that marks an OOD run's shards (docs/contract.md); {} for a plain run."""
    if planned.ood_for is None or data.n_id is None:
        return {}
    return {"zaec:ood_for": planned.ood_for, "zaec:ood_dataset": str(planned.ood_dataset),
            "zaec:ood_n_id": str(data.n_id), "zaec:ood_n_ood": str(data.n_total - data.n_id),
            "zaec:ood_data_root": data.identity["ood_data_root"]}
