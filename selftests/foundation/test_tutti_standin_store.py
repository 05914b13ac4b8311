"""The suite's stand-in Tutti store moves exact bytes and refuses bad input by key.

Driven on CPU tensors the way Tutti's ``KVEngine`` drives a store (``engine/
core.py`` 33a8fb8: ``set_key_namespace`` before ``open``, ``set_layer_span``,
``register_buffer(window.buffer, segment_bytes)``, ``put_batch`` / ``get_batch``
of ``(io_key, buffer id, slot offset)``, ``drop`` on eviction, ``scan`` at cold
start); on CUDA the same with its streams and events (GPU host).
"""

from __future__ import annotations

import pytest

from tvc.store.tutti_standin import (
    STANDIN_TYPE,
    UNDER_TEST,
    StandInKVStore,
    StandInStoreError,
    under_test,
)

pytestmark = [pytest.mark.hw_any]

SEG = 4096


def _store(num_chunks: int = 4, layers: int = 2) -> StandInKVStore:
    st = StandInKVStore(segment_bytes=SEG, num_chunks=num_chunks)
    st.set_key_namespace(b"v2|model=x")
    st.open()
    st.set_layer_span(layers)
    return st


def _staging(device: str, slots: int = 8):
    import torch

    return torch.zeros(slots * SEG, dtype=torch.uint8, device=device)


DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.hw_gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_put_then_get_restores_exact_bytes_into_other_slots(device) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    st = _store()
    buf = _staging(device)
    bid = st.register_buffer(buf, SEG)
    assert bid == 1
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4 * SEG,), dtype=torch.uint8, generator=g)
    buf[: 4 * SEG] = data.to(device)
    keys = [bytes([i]) * 16 + layer.to_bytes(2, "little")
            for i in range(2) for layer in range(2)]
    ev = torch.cuda.Event() if device == "cuda" else None
    if ev is not None:
        ev.record()
        st.wait_write_event(ev)  # the engine's gather fence before each put
    done = st.put_batch([(k, bid, i * SEG) for i, k in enumerate(keys)])
    done.wait()
    assert done.query()
    buf.zero_()
    got = st.get_batch([(k, bid, (4 + i) * SEG) for i, k in enumerate(keys)])
    got.wait()
    assert torch.equal(buf[4 * SEG:].cpu(), data), "bytes differ after get_batch"
    assert not bool(buf[: 4 * SEG].any()), "get_batch wrote outside its slots"
    assert st.stats["puts"] == 4 and st.stats["gets"] == 4
    assert st.stats["bytes_written"] == st.stats["bytes_read"] == 4 * SEG
    assert st.stats["unfenced_puts"] == 0
    assert sorted(st.scan()) == sorted(keys)
    st.drop(keys[:2] + [b"unknown"])
    assert sorted(st.scan()) == sorted(keys[2:])
    st.close()


def test_full_store_unknown_key_and_bad_offsets_are_errors() -> None:
    st = _store(num_chunks=1, layers=1)
    bid = st.register_buffer(bytearray(2 * SEG), SEG)
    st.put_batch([(b"a", bid, 0)])
    with pytest.raises(RuntimeError, match="stand-in store full.*num_chunks"):
        st.put_batch([(b"b", bid, SEG)])
    st.put_batch([(b"a", bid, SEG)])  # overwriting a held key needs no room
    with pytest.raises(ValueError, match="unknown key"):
        st.get_batch([(b"zz", bid, 0)])
    with pytest.raises(ValueError, match="leaves buffer"):
        st.get_batch([(b"a", bid, SEG + 1)])
    with pytest.raises(ValueError, match="not registered"):
        st.get_batch([(b"a", 9, 0)])


def test_register_buffer_refuses_what_it_cannot_serve() -> None:
    import torch

    st = _store()
    assert st.register_buffer(bytes(SEG), SEG) is None  # read-only
    assert st.register_buffer(bytearray(SEG), SEG + 1) is None  # > segment
    assert st.register_buffer(bytearray(SEG), 0) is None
    t = torch.zeros(4, SEG, dtype=torch.uint8).t()  # not contiguous
    assert st.register_buffer(t, SEG) is None
    assert st.register_buffer(torch.zeros(SEG, dtype=torch.float16), SEG) == 1


@pytest.mark.parametrize(("options", "needle"), [
    ({"num_chunks": "256"}, "store.options.num_chunks: expected a positive integer"),
    ({"num_chunks": True}, "store.options.num_chunks: expected a positive integer"),
    ({"num_chunks": 0}, "store.options.num_chunks: expected a positive integer"),
    ({"num_chunks": 4, "root": "/x"}, "store.options.root: not an option"),
    ({"num_chunks": 4, "order": "fifo"},
     "store.options.order: expected one of events, stream, sync, got 'fifo'"),
    ({"num_chunks": 4, "busy_us": -1},
     "store.options.busy_us: expected an integer of 0 to 10000"),
    ({"num_chunks": 4, "busy_us": "50"},
     "store.options.busy_us: expected an integer of 0 to 10000"),
])
def test_bad_options_name_the_key(options, needle) -> None:
    with pytest.raises(StandInStoreError, match=needle.replace(".", r"\.")):
        StandInKVStore(segment_bytes=SEG, **options)


def test_closed_store_refuses_data_calls_and_namespace_after_open() -> None:
    st = _store()
    with pytest.raises(RuntimeError, match="before open"):
        st.set_key_namespace(b"late")
    st.close()
    with pytest.raises(RuntimeError, match="not open"):
        st.put_batch([])


def test_reports_name_the_stand_in_only_when_selected() -> None:
    ktc = {"kv_connector_extra_config": {"store": {"type": STANDIN_TYPE}}}
    assert under_test(ktc) == UNDER_TEST
    assert "not Tutti's NVMe store" in UNDER_TEST
    assert under_test({"kv_connector_extra_config": {"store": {"type": "memory"}}}
                      ) == ""
    assert under_test({}) == ""


def test_profile_tutti_public_selects_the_stand_in() -> None:
    from tvc.config.profile import load

    for name in ("tutti-public", "tutti-public-v1"):
        p = load(name)
        assert under_test(p.kv_transfer_config()) == UNDER_TEST, name
        assert p["connector"]["module_path"] == "tvc.store.tutti_connector"
    assert load("tutti-public-v1")["vllm"]["env"] == {
        "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert load("tutti-public-nvme").kv_transfer_config()[
        "kv_connector_extra_config"]["store"]["type"] == "tutti_nvme"


@pytest.mark.parametrize(("order", "busy_us"), [
    ("events", 0), ("stream", 0), ("sync", 0), ("events", 500)])
@pytest.mark.parametrize("device", DEVICES)
def test_a_get_of_some_stored_chunks_restores_exactly_those(device, order,
                                                            busy_us) -> None:
    """The e2e shape seen red on the H200 (64 tokens: 2 chunks stored, 1 loaded):
    a get of the first chunk of a two-chunk put returns that chunk's bytes, under
    every ``store.options.order``, and with the current stream kept busy (the
    store itself orders its copies after the work before them)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    st = StandInKVStore(segment_bytes=SEG, num_chunks=8, order=order,
                        busy_us=busy_us)
    st.open()
    st.set_layer_span(2)
    buf = _staging(device)
    bid = st.register_buffer(buf, SEG)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4 * SEG,), dtype=torch.uint8, generator=g)
    buf[: 4 * SEG] = data.to(device)
    keys = [bytes([c]) * 16 + layer.to_bytes(2, "little")
            for c in range(2) for layer in range(2)]
    if device == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        st.wait_write_event(ev)
    st.put_batch([(k, bid, i * SEG) for i, k in enumerate(keys)]).wait()
    buf.zero_()
    st.get_batch([(k, bid, (4 + i) * SEG) for i, k in enumerate(keys[:2])]).wait()
    assert torch.equal(buf[4 * SEG:6 * SEG].cpu(), data[: 2 * SEG])
    assert not bool(buf[6 * SEG:].any()) and not bool(buf[: 4 * SEG].any())
