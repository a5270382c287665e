"""Unit: the model registry."""

import pytest
import torch

from ddplab.config import MODEL_NAMES, ModelConfig
from ddplab.training import strategy
from ddplab.workload import models
from ddplab.workload.data import DataInfo


def build(name: str, channels: int, size: int, classes: int) -> torch.nn.Module:
    return models.build(ModelConfig(name=name), DataInfo("image", channels, size, classes))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_name_config_accepts_builds_its_own_architecture(name):
    """Each accepted name builds, takes a batch of its data kind (CIFAR-sized images, or 32
    tokens for gpt), and is the architecture it names (a registry entry pointing at the wrong
    builder would change the parameter count)."""
    if name == "gpt":
        m = models.build(ModelConfig(name="gpt"), DataInfo("tokens", vocab_size=256, seq_len=32))
        x, out = torch.zeros(1, 32, dtype=torch.long), (1, 32, 256)
    else:
        m, x, out = build(name, 3, 32, 10), torch.zeros(1, 3, 32, 32), (1, 10)
    with torch.no_grad():
        assert m.eval()(x).shape == out
    params = sum(p.numel() for p in m.parameters())  # gpt's output layer shares wte's weights
    assert params == EXPECTED_PARAMS[name]


# Parameter counts at 10 classes: torchvision's models (weights=None) and the book's CNN
# (conv 3->32, conv 32->64, 4096->512, 512->10).
EXPECTED_PARAMS = {
    "cnn": 896 + 18496 + 2097664 + 5130,
    "resnet18": 11181642, "resnet50": 23528522,
    "efficientnet_b0": 4020358, "efficientnet_b1": 6525994, "efficientnet_b2": 7715084,
    "efficientnet_b3": 10711602, "efficientnet_b4": 17566546, "efficientnet_b5": 28361274,
    "efficientnet_b6": 40758754, "efficientnet_b7": 63812570,
    # wte 256x128 + wpe 32x128 + 2 blocks x (2 LayerNorms 512 + qkv 49,536 + proj 16,512 +
    # MLP 66,048 + 65,664) + ln_f 256
    "gpt": 32768 + 4096 + 2 * (512 + 49536 + 16512 + 66048 + 65664) + 256,
}


@pytest.mark.parametrize("name, size", [("cnn", 32), ("cnn", 12), ("resnet18", 32),
                                        ("efficientnet_b0", 32)])
def test_builds_with_num_classes(name, size):
    m = build(name, 3, size, 7).eval()
    with torch.no_grad():
        assert m(torch.zeros(2, 3, size, size)).shape == (2, 7)


def test_book_cnn_layout():
    m = models.BookCNN(3, 32, 10)
    convs = [layer for layer in m.modules() if isinstance(layer, torch.nn.Conv2d)]
    linears = [layer for layer in m.modules() if isinstance(layer, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [32, 64]
    assert [f.out_features for f in linears] == [512, 10]


def test_unknown_model_lists_choices():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="unknown model 'vgg'; choose one of: cnn, gpt, resnet18"):
        models.build(SimpleNamespace(name="vgg", args={}), DataInfo("image", 3, 32, 10))


def test_ipex_absent_or_mismatched_is_a_status_not_a_failure():
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    from ddplab.config import ModelConfig
    with pytest.warns(UserWarning, match="IPEX not used"):
        m2, opt2, status = strategy.maybe_ipex(m, opt, ModelConfig(), torch.device("cpu"), "none")
    assert m2 is m and opt2 is opt and not status.used and status.reason


def test_a_model_builder_taking_kwargs_gets_the_datas_num_classes():
    """torchvision's builders take num_classes through **kwargs: a 1000-way head used to train
    silently on 10 classes. A value the user set still wins."""
    from torchvision.models import mobilenet_v3_small

    info, name = DataInfo("image", 3, 32, 10), "torchvision.models:mobilenet_v3_small"
    m = models.build(ModelConfig(name=name), info, mobilenet_v3_small).eval()
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    m = models.build(ModelConfig(name=name, args={"num_classes": 7}), info, mobilenet_v3_small)
    assert m.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_an_fsdp_wrap_naming_no_class_of_the_model_is_one_line():
    """dist.fsdp.wrap=GPT2Blok (a typo) used to shard the whole model as one unit, silently."""
    from ddplab.config import ConfigError, load

    cfg = load(None, ["model.name=gpt", "dist.strategy=fsdp", "dist.fsdp.wrap=Blok,Block"])
    model = models.build(cfg.model, DataInfo("tokens", vocab_size=256, seq_len=32))
    with pytest.raises(ConfigError, match=r"dist.fsdp.wrap: got 'Blok,Block'; the model has no "
                                          r"module class Blok: choose among .*Block"):
        strategy.block_names(cfg, model)
    cfg = load(None, ["model.name=gpt", "dist.strategy=fsdp", "dist.fsdp.wrap=Block"])
    assert strategy.block_names(cfg, model) == {"Block"}


def test_a_part_from_an_installed_library_records_its_distribution_not_untracked():
    import torchvision

    from ddplab.workload import userparts

    got = userparts.provenance("torchvision.models:mobilenet_v3_small")
    assert got["git"] == "installed (site-packages)"
    assert got["dist"] == f"torchvision {torchvision.__version__.split('+')[0]}"
