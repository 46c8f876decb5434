"""Data for hookexp runs, one module per source: the factories ``data.dataset._target_`` names, and
:func:`as_splits`, which turns whatever a factory returns into one :class:`Splits` (docs/models.md).

A factory returns a :class:`Splits`, a pair ``(train, val)``, a mapping with ``train`` and ``val`` or
``validation``, or one data set split by ``data.val_fraction``; ``Splits.info`` (``num_classes``,
``vocab_size``, ...) fills a model's ``auto`` values. In-memory sets are :class:`TensorSet` s, which hand the
DataLoader whole batches. Modules: ``splits``, ``collate`` (padding), ``local`` (paths, optional packages), and
one per source: ``arrays``, ``grokking``, ``text``, ``vision``, ``hf``. Import the names from here
(``hookexp.workloads.data.digits``).
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
    input_shape,
    input_size,
    labels_of,
    whole_batch,
)
from hookexp.workloads.data.text import CharTokenizer, TokenWindows, text_file
from hookexp.workloads.data.vision import VISION, torchvision

__all__ = ["ACCEPTED", "OPS", "VISION", "CharTokenizer", "PadCollate", "Splits", "TensorSet", "TokenWindows",
           "as_splits", "check_fraction", "classes_in", "digits", "hf_disk", "input_shape", "input_size", "labels_of",
           "modular_addition", "pad_collate", "synthetic", "synthetic_regression", "text_file", "torchvision",
           "whole_batch"]
