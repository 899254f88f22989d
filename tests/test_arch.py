import pytest

import w4a16


@pytest.mark.parametrize(
    "raw, expected",
    [("gfx1151", "gfx1151"), ("gfx1201:sramecc-:xnack-", "gfx1201"), ("GFX942:xnack+", "gfx942"),
     ("sm_90", "sm_90"), ("sm90", "sm_90"), ("sm_90a", "sm_90"), ((9, 0), "sm_90"), ((8, 6), "sm_86"), ("cpu", "cpu")],
)
def test_normalize_arch(raw, expected):
    assert w4a16.normalize_arch(raw) == expected


@pytest.mark.parametrize("raw", ["Strix Halo", "H200", ""])
def test_normalize_arch_rejects_marketing_names(raw):
    with pytest.raises(ValueError, match="unrecognised architecture"):
        w4a16.normalize_arch(raw)


def test_arch_of_cpu_device():
    assert w4a16.arch("cpu") == "cpu"
