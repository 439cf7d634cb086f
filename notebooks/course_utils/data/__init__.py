"""Datasets and DataLoaders for the course: ``synthetic`` (the generator), ``sources`` (every data
set behind :func:`get_datasets`, downloads), ``loaders`` (DataLoaders), ``text`` (byte tokens for the
transformer, scripts/train_lm.py) and the download command line.

Three sources, one interface (:func:`get_datasets`):

* ``synthetic`` (the offline default): ten classes of shapes and textures
  drawn procedurally with random position, size, colour and noise. It needs
  no download, is the same on every machine for a given seed, and a CNN can
  learn it (it is not noise), so a notebook on an offline compute node still
  teaches something.
* ``cifar10`` and ``mnist``: the real data sets through torchvision. Compute
  nodes are often offline, so fetch them once on a login node::

      python -m course_utils.data download cifar10 --root $STORE/data

  and point ``--data-root`` or ``$COURSE_DATA`` at that folder.
* ``mnist-idx``: the MNIST test set as raw idx files in a folder (for example
  ``../shared/data/mnist-t10k``), read without torchvision.
"""

from .loaders import ResumableSampler, make_loader, set_epoch
from .sources import (
    DATASETS,
    INFO,
    DatasetInfo,
    DatasetMissingError,
    TensorImageDataset,
    default_data_root,
    download,
    get_datasets,
    held_out_set,
    load_mnist_idx,
    read_idx,
    verify_md5sums,
    workshop_dataset,
)
from .synthetic import CLASS_NAMES, make_synthetic

__all__ = [
    "CLASS_NAMES", "DATASETS", "INFO", "DatasetInfo", "DatasetMissingError", "ResumableSampler",
    "TensorImageDataset", "default_data_root", "download", "get_datasets", "held_out_set", "load_mnist_idx",
    "make_loader", "make_synthetic", "read_idx", "set_epoch", "verify_md5sums", "workshop_dataset",
]
