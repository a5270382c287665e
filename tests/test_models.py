"""Unit: the model registry."""

import pytest
import torch

from ddplab import models
from ddplab.config import MODEL_NAMES


def test_registry_matches_the_names_config_accepts():
    assert tuple(models.REGISTRY) == MODEL_NAMES


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
