"""Unit: the model registry."""

import pytest
import torch

from ddplab import models
from ddplab.config import MODEL_NAMES


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_name_config_accepts_builds_its_own_architecture(name):
    """Each accepted name builds, takes a CIFAR-sized batch, and is the architecture it names
    (a registry entry pointing at the wrong builder would change the parameter count)."""
    m = models.build(name, 3, 32, 10).eval()
    with torch.no_grad():
        assert m(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
    params = sum(p.numel() for p in m.parameters())
    assert params == EXPECTED_PARAMS[name]


# Parameter counts at 10 classes: torchvision's models (weights=None) and the book's CNN
# (conv 3->32, conv 32->64, 4096->512, 512->10).
EXPECTED_PARAMS = {
    "cnn": 896 + 18496 + 2097664 + 5130,
    "resnet18": 11181642, "resnet50": 23528522,
    "efficientnet_b0": 4020358, "efficientnet_b1": 6525994, "efficientnet_b2": 7715084,
    "efficientnet_b3": 10711602, "efficientnet_b4": 17566546, "efficientnet_b5": 28361274,
    "efficientnet_b6": 40758754, "efficientnet_b7": 63812570,
}


@pytest.mark.parametrize("name, size", [("cnn", 32), ("cnn", 12), ("resnet18", 32),
                                        ("efficientnet_b0", 32)])
def test_builds_with_num_classes(name, size):
    m = models.build(name, 3, size, 7).eval()
    with torch.no_grad():
        assert m(torch.zeros(2, 3, size, size)).shape == (2, 7)


def test_book_cnn_layout():
    m = models.BookCNN(3, 32, 10)
    convs = [layer for layer in m.modules() if isinstance(layer, torch.nn.Conv2d)]
    linears = [layer for layer in m.modules() if isinstance(layer, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [32, 64]
    assert [f.out_features for f in linears] == [512, 10]


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match="unknown model 'vgg'; choose one of: cnn, resnet18"):
        models.build("vgg", 3, 32, 10)


def test_ipex_absent_or_mismatched_is_a_status_not_a_failure():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    from ddplab.config import ModelConfig
    with pytest.warns(UserWarning, match="IPEX not used"):
        m2, opt2, status = models.maybe_ipex(m, opt, ModelConfig(), torch.device("cpu"), "none")
    assert m2 is m and opt2 is opt and not status.used and status.reason
