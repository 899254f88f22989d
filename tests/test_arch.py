import types

import pytest
import torch

import w4a16


@pytest.mark.parametrize(
    "raw, expected",
    [("gfx1151", "gfx1151"), ("gfx1201:sramecc-:xnack-", "gfx1201"), ("GFX942:xnack+", "gfx942"),
     ("sm_90", "sm_90"), ("sm90", "sm_90"), ("sm_90a", "sm_90"), ((9, 0), "sm_90"), ((8, 6), "sm_86"), ("cpu", "cpu"),
     # nvcc's virtual-architecture spelling, three-digit compute capabilities, MI200's hex digit, stray whitespace
     ("compute_90", "sm_90"), ("compute_100a", "sm_100"), ("sm_120", "sm_120"), ("gfx90a:sramecc+:xnack-", "gfx90a"),
     (" gfx1151\n", "gfx1151"), (" SM_90 ", "sm_90")],
)
def test_normalize_arch(raw, expected):
    assert w4a16.normalize_arch(raw) == expected


@pytest.mark.parametrize("raw", ["Strix Halo", "H200", ""])
def test_normalize_arch_rejects_marketing_names(raw):
    with pytest.raises(ValueError, match="unrecognised architecture"):
        w4a16.normalize_arch(raw)


def test_arch_of_cpu_device():
    assert w4a16.arch("cpu") == "cpu"


def test_normalize_arch_rejects_other_types():
    with pytest.raises(TypeError, match=r"arch name must be a string or a \(major, minor\) tuple, got int"):
        w4a16.normalize_arch(90)


# One visible GPU per case, as torch describes it: CUDA names the compute capability, ROCm the gcnArchName (with
# its feature suffix; its major/minor are not an sm_ number).
GPUS = {"cuda": (None, types.SimpleNamespace(major=8, minor=9, gcnArchName="")),
        "rocm": ("6.4.0", types.SimpleNamespace(major=11, minor=5, gcnArchName="gfx1151:sramecc-:xnack-"))}


@pytest.mark.parametrize(("platform", "expected"), [("cuda", "sm_89"), ("rocm", "gfx1151")])
def test_arch_of_a_gpu(monkeypatch, platform, expected):
    hip, props = GPUS[platform]
    asked = []
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or props)
    assert w4a16.arch() == expected
    assert w4a16.arch(1) == expected and w4a16.arch("cuda:1") == expected
    assert w4a16.arch("cpu") == "cpu"  # a CPU tensor's arch, with a GPU present
    assert asked == [0, torch.device("cuda", 1), torch.device("cuda", 1)]
