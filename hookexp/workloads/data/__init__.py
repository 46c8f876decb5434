"""Data for hookexp runs, one module per source: the factories ``data.dataset._target_`` names, and
:func:`as_splits`, which turns whatever a factory returns into one :class:`Splits`.

A factory may return a :class:`Splits`, a pair ``(train, val)``, a mapping with ``train`` and ``val`` or
``validation`` (a HF ``DatasetDict`` qualifies), or one data set that :func:`as_splits` splits by
``data.val_fraction``. ``Splits.info`` carries what the data knows and a model needs (``num_classes``,
``vocab_size``, ...): a model config value ``auto`` is filled from it, so one model file fits every data set.

The shipped factories need no download: ``digits`` (scikit-learn), ``synthetic`` and ``synthetic_regression``
(seeded generators), ``modular_addition`` (the grokking task), ``text_file`` (any local UTF-8 file),
``torchvision`` (MNIST/CIFAR from a local folder) and ``hf_disk`` (a HF ``datasets`` folder or local files).
In-memory sets are :class:`TensorSet`\\ s, which hand the DataLoader whole batches through ``__getitems__``
(one index op per batch, no per-example Python); their Splits name :func:`whole_batch` as the collate function.

Modules: :mod:`~hookexp.workloads.data.splits` (:class:`Splits`, :func:`as_splits`, the shared checks),
:mod:`~hookexp.workloads.data.collate` (padding), :mod:`~hookexp.workloads.data.local` (local paths, optional
packages), and one per source: ``arrays`` (digits, synthetic, synthetic_regression), ``grokking``
(modular_addition), ``text`` (text_file), ``vision`` (torchvision), ``hf`` (hf_disk). Import the names from
here (``hookexp.workloads.data.digits``).
"""

from __future__ import annotations

from hookexp.workloads.data.arrays import digits, synthetic, synthetic_regression
from hookexp.workloads.data.collate import PadCollate, pad_collate
from hookexp.workloads.data.grokking import OPS, modular_addition
from hookexp.workloads.data.hf import hf_disk
from hookexp.workloads.data.splits import (
    ACCEPTED,
    Splits,
    TensorSet,
    as_splits,
    check_fraction,
    classes_in,
    input_size,
    labels_of,
    whole_batch,
)
from hookexp.workloads.data.text import CharTokenizer, TokenWindows, text_file
from hookexp.workloads.data.vision import VISION, torchvision

__all__ = ["ACCEPTED", "OPS", "VISION", "CharTokenizer", "PadCollate", "Splits", "TensorSet", "TokenWindows",
           "as_splits", "check_fraction", "classes_in", "digits", "hf_disk", "input_size", "labels_of",
           "modular_addition", "pad_collate", "synthetic", "synthetic_regression", "text_file", "torchvision",
           "whole_batch"]
