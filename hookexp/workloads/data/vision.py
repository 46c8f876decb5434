"""``torchvision``: MNIST, FashionMNIST, CIFAR-10 and CIFAR-100 from a local folder."""

from __future__ import annotations

from hookexp.errors import ConfigError, did_you_mean
from hookexp.workloads.data.arrays import _image_info
from hookexp.workloads.data.local import _base_dir, _existing
from hookexp.workloads.data.splits import Splits

# name -> (torchvision class, channels, image size, classes, mean, std, the files its root must hold)
VISION = {
    "mnist": ("MNIST", 1, 28, 10, (0.1307,), (0.3081,),
              "ROOT/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "fashion_mnist": ("FashionMNIST", 1, 28, 10, (0.2860,), (0.3530,),
                      "ROOT/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "cifar10": ("CIFAR10", 3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
                "ROOT/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"),
    "cifar100": ("CIFAR100", 3, 32, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
                 "ROOT/cifar-100-python/{train,test,meta}"),
}


def torchvision(name: str = "mnist", root: str = "data", download: bool = False, normalize: bool = True) -> Splits:
    """MNIST, FashionMNIST, CIFAR-10 or CIFAR-100 from a local folder: the official train set to train, the
    test set to validate; batches ``(x [B, C, H, W] float, y [B] long)``, normalised by the set's mean and std.

    Nothing is downloaded unless ``download=true``. ``info``: num_classes, in_channels, image_size, input_dim,
    output_dim.
    """
    if name not in VISION:
        raise ConfigError(f"unknown data set {name!r}.{did_you_mean(str(name), VISION)} Use one of "
                          f"{', '.join(VISION)}.", key="data.name")
    cls_name, channels, size, classes, mean, std, layout = VISION[name]
    import importlib

    try:
        tv = importlib.import_module("torchvision")
        datasets, transforms = tv.datasets, tv.transforms
    except Exception as e:  # not installed, or a build that does not match this torch
        raise ConfigError(f"data=torchvision needs torchvision, which does not import here ({type(e).__name__}: "
                          f"{e}). Install the build that matches your torch: pip install 'hookexp[vision]' beside a "
                          "CUDA torch from PyPI; with a CPU torch, pip install torchvision --index-url "
                          "https://download.pytorch.org/whl/cpu (the PyPI wheel is built for the CUDA torch and does "
                          "not import beside the CPU one).", key="data") from None
    if download:  # torchvision makes the folder and fills it
        folder = _base_dir() / str(root)
    else:
        folder = _existing(root, "data.root", f"the folder that holds {cls_name} ({layout})")
    steps = [transforms.ToTensor()] + ([transforms.Normalize(mean, std)] if normalize else [])
    transform = transforms.Compose(steps)
    try:
        train = getattr(datasets, cls_name)(str(folder), train=True, transform=transform, download=download)
        val = getattr(datasets, cls_name)(str(folder), train=False, transform=transform, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted. You can use download=True ..."
        expected = layout.replace("ROOT", str(folder))
        raise ConfigError(f"{folder} does not hold {cls_name} ({e}). Expected layout: {expected}; put the files "
                          "there, point data.root at their folder, or set data.download=true where there is "
                          "internet.", key="data.root") from None
    return Splits(train, val, _image_info(channels, size, classes))
