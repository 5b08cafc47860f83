"""PackedRows against a plain list of rows: any sequence of appends, windows sliding
forward and rollbacks leaves exactly the rows the list holds, in bytes and values."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.formats import COMPRESSED_KV, WINDOW_KV, Packed
from model.runtime.cache import PackedRows

pytestmark = pytest.mark.unit

operations = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),
    st.tuples(st.just("drop_front"), st.integers(-2, 50)),
    st.tuples(st.just("truncate"), st.integers(0, 60)),
), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=operations, fp4=st.booleans(), seed=st.integers(0, 2**16))
def test_rows_follow_a_list(ops, fp4, seed):
    fmt, dim = (COMPRESSED_KV, 64) if fp4 else (WINDOW_KV, 64)
    rows = PackedRows(fmt, dim)
    generator = torch.Generator().manual_seed(seed)
    model_bytes, model_values = [], []
    for op, k in ops:
        if op == "append":
            raw = torch.randn(k, dim, generator=generator) * 3
            values = rows.append(raw)
            packed = fmt.quantize(raw)
            expected = torch.cat((packed.data, packed.scales), dim=-1)
            model_bytes += list(expected)
            model_values += list(fmt.dequantize(Packed(packed.data, packed.scales)))
            assert torch.equal(values, torch.stack(model_values[-k:]))
        elif op == "drop_front":
            del model_bytes[:max(k, 0)], model_values[:max(k, 0)]
            rows.drop_front(k)
        else:
            del model_bytes[k:], model_values[k:]
            rows.truncate(k)
        assert rows.n == len(model_bytes) and rows.nbytes == rows.n * rows.row_bytes
        if model_bytes:
            assert torch.equal(rows.data, torch.stack(model_bytes))
            assert torch.equal(rows.values, torch.stack(model_values))
            assert torch.equal(rows.decode(rows.data), rows.values)


def test_a_sliding_window_keeps_a_bounded_buffer():
    """A window that gains a row and drops its oldest at every step reuses its buffer:
    after 2,000 steps it holds the last 32 rows in at most 4 x 32 buffer rows."""
    rows, generator = PackedRows(WINDOW_KV, 64), torch.Generator().manual_seed(0)
    raw = torch.randn(2000, 64, generator=generator)
    for step in range(2000):
        rows.append(raw[step : step + 1])
        rows.drop_front(rows.n - 32)
    assert rows.n == 32 and rows._data.shape[0] <= 128
    assert torch.equal(rows.values, WINDOW_KV.fake_quant(raw[-32:]))
