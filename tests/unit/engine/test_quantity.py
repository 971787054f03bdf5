import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillway_engine.quantity import QuantityError, format_bytes, human_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64Gi", 64 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("500M", 500_000_000),
        ("1e9", 1_000_000_000),
        ("1073741824", 2**30),
        ("0.5", 1),  # fractions of a byte round up
        (" 2Ki ", 2048),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "Gi", "64GB", "-1Gi", "abc", "64 Gx", "1m", True, -5])
def test_parse_bytes_rejects(text):
    with pytest.raises(QuantityError):
        parse_bytes(text)


@given(st.integers(min_value=0, max_value=2**62))
def test_format_round_trips(value):
    assert parse_bytes(format_bytes(value)) == value


def test_format_prefers_largest_exact_suffix():
    assert format_bytes(64 * 2**30) == "64Gi"
    assert format_bytes(1536 * 2**20) == "1536Mi"
    assert format_bytes(1000) == "1000"
    assert format_bytes(0) == "0"


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(5 * 2**29) == "2.50 GiB"
