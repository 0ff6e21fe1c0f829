"""Hostile and broken pickled extra state: described without running, never run.

Every payload of the hostile corpus creates a marker file when an ordinary unpickler
loads it (``test_the_corpus_is_live`` checks that, so the other tests mean something).
fastcast must neither run it while describing it for the refusal message nor while
loading it inside ``fc.allow_unsafe_extra_state()``, and the message must name what the
payload would run, or say that it is unknown, never list only harmless globals.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import pickle
import pickletools
import shlex
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fastcast as fc
from fastcast.serialization import pickle_machine, pickle_payloads, unpickling
from fastcast.serialization import pickle_model as pickles
from fastcast.serialization.transformer_engine import (
    TE_ALLOW_LIST,
    TE_RECIPE_MODULE,
    TE_STAND_INS,
)

pytestmark = pytest.mark.usefixtures("single_thread")

SYSTEM = f"{os.system.__module__}.system"  # posix.system here: how os.system pickles


# -- writing pickles by hand ------------------------------------------------------------------
def _text(value: str) -> bytes:
    data = value.encode()
    if len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _bytes(data: bytes) -> bytes:
    return pickle.BINBYTES + struct.pack("<I", len(data)) + data


def _get(index: int) -> bytes:
    return pickle.BINGET + bytes([index])


PROTO2 = pickle.PROTO + b"\x02"
PROTO4 = pickle.PROTO + b"\x04"
SYS_MODULE, SYS_NAME = SYSTEM.split(".")


class _Reduce:
    """Pickles as ``func(*args)``: what a hostile file calls at load time."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args

    def __call__(self, *args):  # pickle insists; only ever called by an unpickler
        raise AssertionError("not to be called here")


def _shell(marker: str) -> str:
    return f"touch {shlex.quote(marker)}"


def _python(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


def _torch_save(obj, legacy=False) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def _decoy_archive(marker: str) -> bytes:
    """A torch.save archive with a harmless ``archive/decoy/data.pkl`` before the real
    ``archive/data.pkl``: torch reads the latter, a careless reader the first ``data.pkl``."""
    real = zipfile.ZipFile(io.BytesIO(_torch_save(_Reduce(os.system, _shell(marker)))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/decoy/data.pkl", pickle.dumps({}, protocol=2))
        for info in real.infolist():
            archive.writestr(info.filename, real.read(info))
    return out.getvalue()


def _int_first(data: bytes) -> bytes:
    """``data`` behind ``INT 0x10`` and ``POP``: pickle reads INT in base 0 (a model reading
    base 10 would stop at the first byte and describe nothing)."""
    return b"I0x10\n" + pickle.POP + data


def _int_first_archive(marker: str) -> bytes:
    """A torch.save archive whose data.pkl starts with ``INT 0x10``."""
    real = zipfile.ZipFile(io.BytesIO(_torch_save(_Reduce(os.system, _shell(marker)))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in real.infolist():
            data = real.read(info)
            if info.filename.endswith("/data.pkl"):
                data = _int_first(data)
            archive.writestr(info.filename, data)
    return out.getvalue()


def _framed_past_stop(marker: str) -> bytes:
    """A legacy torch.save stream whose first pickle is framed with decoy pickles after its
    STOP: torch.load reads the whole frame, so its next pickle starts after the decoys (a
    model reading on from the STOP would spend its five pickles on them)."""
    stream = _torch_save(_Reduce(os.system, _shell(marker)), legacy=True)
    first = len(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
    frame = stream[2:first] + (pickle.NONE + pickle.STOP) * 4
    return PROTO4 + pickle.FRAME + struct.pack("<Q", len(frame)) + frame + stream[first:]


# name -> (payload builder given the marker path, what both messages must contain)
CORPUS = {
    "legacy-torch.save-stream-framed-past-its-first-STOP": (
        _framed_past_stop,
        (f"{SYSTEM} (called)",),
    ),
    "INT-in-base-0-first-raw-pickle": (
        lambda m: _int_first(pickle.dumps(_Reduce(os.system, _shell(m)), protocol=2)),
        (f"{SYSTEM} (called)",),
    ),
    "INT-in-base-0-first-legacy-torch.save-stream": (  # its magic-number pickle
        lambda m: _int_first(_torch_save(_Reduce(os.system, _shell(m)), legacy=True)),
        (f"{SYSTEM} (called)",),
    ),
    "INT-in-base-0-first-torch.save-archive": (_int_first_archive, (f"{SYSTEM} (called)",)),
    **{
        f"os.system-protocol-{p}": (
            lambda m, p=p: pickle.dumps(_Reduce(os.system, _shell(m)), protocol=p),
            (f"{SYSTEM} (called)",),
        )
        for p in range(6)
    },
    "subprocess-protocol-3": (  # below 3, pickle writes it as commands.getoutput
        lambda m: pickle.dumps(_Reduce(subprocess.getoutput, _shell(m)), protocol=3),
        ("subprocess.getoutput (called)",),
    ),
    "eval-protocol-0": (  # written __builtin__.eval at protocols below 3
        lambda m: pickle.dumps(_Reduce(eval, _python(m)), protocol=0),
        ("builtins.eval (written __builtin__.eval, called)",),
    ),
    "eval-protocol-4": (
        lambda m: pickle.dumps(_Reduce(eval, _python(m)), protocol=4),
        ("builtins.eval (called)",),
    ),
    "exec-protocol-5": (
        lambda m: pickle.dumps(_Reduce(exec, _python(m)), protocol=5),
        ("builtins.exec (called)",),
    ),
    "import-getattr-chain": (  # getattr(__import__("os"), "system")(cmd)
        lambda m: pickle.dumps(
            _Reduce(_Reduce(getattr, _Reduce(builtins.__import__, "os"), "system"), _shell(m)),
            protocol=4,
        ),
        ("builtins.__import__ (called)", "unknown", "calls what builtins.getattr returned"),
    ),
    "INST": (
        lambda m: (
            b"(S" + repr(_shell(m)).encode() + b"\ni" + f"{SYS_MODULE}\n{SYS_NAME}\n.".encode()
        ),
        (f"{SYSTEM} (called)",),
    ),
    "OBJ": (
        lambda m: b"(" + _global(SYS_MODULE, SYS_NAME) + _text(_shell(m)) + pickle.OBJ + b".",
        (f"{SYSTEM} (called)",),
    ),
    "STACK_GLOBAL-names-from-the-memo-after-a-popped-decoy": (
        lambda m: (
            PROTO4
            + _text(SYS_MODULE)
            + pickle.MEMOIZE
            + _text(SYS_NAME)
            + pickle.MEMOIZE
            + _text("collections")
            + _text("OrderedDict")
            + pickle.POP
            + pickle.POP
            + _get(0)
            + _get(1)
            + pickle.STACK_GLOBAL
            + _text(_shell(m))
            + pickle.TUPLE1
            + pickle.REDUCE
            + pickle.STOP
        ),
        (f"{SYSTEM} (called)",),
    ),
    "STACK_GLOBAL-after-a-popped-mark": (
        lambda m: (
            PROTO4
            + _text(SYS_MODULE)
            + _text(SYS_NAME)
            + pickle.MARK
            + _text("collections")
            + _text("OrderedDict")
            + pickle.POP_MARK
            + pickle.STACK_GLOBAL
            + _text(_shell(m))
            + pickle.TUPLE1
            + pickle.REDUCE
            + pickle.STOP
        ),
        (f"{SYSTEM} (called)",),
    ),
    "decoy-global-pushed-then-popped": (
        lambda m: (
            PROTO2
            + _global("collections", "OrderedDict")
            + pickle.POP
            + _global(SYS_MODULE, SYS_NAME)
            + _text(_shell(m))
            + pickle.TUPLE1
            + pickle.REDUCE
            + pickle.STOP
        ),
        (f"{SYSTEM} (called)",),
    ),
    "NEWOBJ-partial-then-called": (
        lambda m: (
            PROTO2
            + _global("functools", "partial")
            + _global(SYS_MODULE, SYS_NAME)
            + _text(_shell(m))
            + pickle.TUPLE2
            + pickle.NEWOBJ
            + pickle.EMPTY_TUPLE
            + pickle.REDUCE
            + pickle.STOP
        ),
        (SYSTEM, "functools.partial (called)", "unknown"),
    ),
    "NEWOBJ_EX-partial-then-called": (
        lambda m: (
            PROTO4
            + _text("functools")
            + _text("partial")
            + pickle.STACK_GLOBAL
            + _text(SYS_MODULE)
            + _text(SYS_NAME)
            + pickle.STACK_GLOBAL
            + _text(_shell(m))
            + pickle.TUPLE2
            + pickle.EMPTY_DICT
            + pickle.NEWOBJ_EX
            + pickle.EMPTY_TUPLE
            + pickle.REDUCE
            + pickle.STOP
        ),
        (SYSTEM, "functools.partial (called)", "unknown"),
    ),
    "BUILD-installs-a-__setstate__-that-the-next-BUILD-calls": (
        lambda m: (
            PROTO2
            + _global("types", "SimpleNamespace")
            + pickle.EMPTY_TUPLE
            + pickle.REDUCE
            + pickle.EMPTY_DICT
            + _text("__setstate__")
            + _global(SYS_MODULE, SYS_NAME)
            + pickle.SETITEM
            + pickle.BUILD
            + _text(_shell(m))
            + pickle.BUILD
            + pickle.STOP
        ),
        (SYSTEM, "types.SimpleNamespace (called)", "unknown"),
    ),
    "python-2-name-protocol-2": (  # commands.getoutput loads as subprocess.getoutput
        lambda m: (
            PROTO2
            + _global("commands", "getoutput")
            + _text(_shell(m))
            + pickle.TUPLE1
            + pickle.REDUCE
            + pickle.STOP
        ),
        ("subprocess.getoutput (written commands.getoutput, called)",),
    ),
    "python-2-name-protocol-0": (
        lambda m: b"ccommands\ngetoutput\n(S" + repr(_shell(m)).encode() + b"\ntR.",
        ("subprocess.getoutput (written commands.getoutput, called)",),
    ),
    "name-computed-at-load-time": (  # STACK_GLOBAL(str("posix"), "system")
        lambda m: (
            PROTO4
            + _text("builtins")
            + _text("str")
            + pickle.STACK_GLOBAL
            + _text(SYS_MODULE)
            + pickle.TUPLE1
            + pickle.REDUCE
            + _text(SYS_NAME)
            + pickle.STACK_GLOBAL
            + _text(_shell(m))
            + pickle.TUPLE1
            + pickle.REDUCE
            + pickle.STOP
        ),
        ("unknown", "a global whose name is computed at load time", "builtins.str (called)"),
    ),
    "torch.save-archive-nested-in-_load_from_bytes": (  # TransformerEngine 2.x's form
        lambda m: pickle.dumps(
            _Reduce(torch.storage._load_from_bytes, _torch_save(_Reduce(os.system, _shell(m)))),
            protocol=4,
        ),
        (f"{SYSTEM} (called)", "torch.storage._load_from_bytes (called)"),
    ),
    "legacy-torch.save-stream-nested-protocol-2": (  # bytes pickled as _codecs.encode
        lambda m: pickle.dumps(
            _Reduce(
                torch.storage._load_from_bytes,
                _torch_save(_Reduce(os.system, _shell(m)), legacy=True),
            ),
            protocol=2,
        ),
        (f"{SYSTEM} (called)", "_codecs.encode (called)"),
    ),
    "pickle-nested-in-pickle.loads": (
        lambda m: pickle.dumps(
            _Reduce(pickle.loads, pickle.dumps(_Reduce(os.system, _shell(m)))), protocol=5
        ),
        (f"{SYSTEM} (called)", "_pickle.loads (called)"),
    ),
    "torch.save-archive": (  # TransformerEngine 1.x's form
        lambda m: _torch_save(_Reduce(os.system, _shell(m))),
        (f"{SYSTEM} (called)",),
    ),
    "torch.save-archive-with-a-decoy-data.pkl-first": (
        _decoy_archive,
        (f"{SYSTEM} (called)",),
    ),
}

FORMS = ["bytes", "uint8", "bytesio"]


def _wrap(data: bytes, form: str):
    if form == "bytes":
        return data
    if form == "uint8":
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return io.BytesIO(data)


def _load_extra(module, payload):
    sd = module.state_dict()
    sd["_extra_state"] = payload
    return module.load_state_dict(sd)


def _stock_load(data: bytes) -> None:
    """What ordinary loaders do with the payload (TransformerEngine 2.x: pickle.loads;
    1.x: torch.load, which reads a legacy stream's pickles one after another)."""
    loaders = [lambda: torch.load(io.BytesIO(data), weights_only=False)]
    if not data.startswith(pickles.ZIP_MAGIC):
        loaders.append(lambda: pickle.loads(data))
    for load in loaders:
        try:
            load()
        except Exception:  # noqa: BLE001 - some payloads fail after their effect
            pass


@pytest.mark.parametrize("name", CORPUS)
def test_the_corpus_is_live(name, tmp_path):
    marker = tmp_path / "pwned"
    _stock_load(CORPUS[name][0](str(marker)))
    assert marker.exists(), "this payload would not run anything: the tests below prove nothing"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", CORPUS)
def test_hostile_payload_never_runs(name, form, tmp_path):
    build, expected = CORPUS[name]
    marker = tmp_path / "pwned"
    payload = _wrap(build(str(marker)), form)
    lin = fc.Linear(4, 4)
    with pytest.raises(ValueError, match="refusing a pickled extra state") as refused:
        _load_extra(lin, payload)
    assert not marker.exists()
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match="refusing") as opted:
        _load_extra(lin, payload)
    assert not marker.exists()
    assert fc.read_extra_state(lin.get_extra_state())["kind"] == "stateless"
    for message in (str(refused.value), str(opted.value)):
        for text in expected:
            assert text in message
        assert "importing nothing" not in message


_ARCHIVES = ("torch.save-archive", "INT-in-base-0-first-torch.save-archive")


@pytest.mark.parametrize("name", [n for n in CORPUS if not n.startswith(_ARCHIVES)])
def test_the_restricted_unpickler_alone_refuses_by_name(name, tmp_path):
    # Below the description: the unpickler's own allow-list, given the payload directly.
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match=r"(?i)not allowed|unsupported global"):
        unpickling._load_stream(CORPUS[name][0](str(marker)), TE_ALLOW_LIST)
    assert not marker.exists()


@pytest.mark.parametrize("name", [n for n in CORPUS if n.startswith(_ARCHIVES)])
def test_the_restricted_archive_loader_alone_refuses_by_name(name, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match=f"{SYSTEM} is not allowed"):
        unpickling._load_archive(CORPUS[name][0](str(marker)), TE_ALLOW_LIST)
    assert not marker.exists()


def test_nested_bytes_load_with_weights_only(tmp_path):
    # torch.storage._load_from_bytes is allowed, but what it is given loads with
    # torch.load(weights_only=True), which refuses os.system.
    marker = tmp_path / "pwned"
    inner = _torch_save(_Reduce(os.system, _shell(str(marker))), legacy=True)
    with pytest.raises(pickle.UnpicklingError):
        unpickling._load_nested_storage(inner)
    assert not marker.exists()


# -- what the description says ------------------------------------------------------------------
def _describe(data: bytes) -> str:
    return pickles.describe_pickle(data, TE_ALLOW_LIST)


def test_transformer_engine_forms_describe_in_full():
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3)}
    for data in (pickle.dumps(state), _torch_save(state)):
        report = pickles.inspect_pickle(data, TE_ALLOW_LIST)
        assert report.loadable, str(report)
        text = str(report)
        assert "torch._utils._rebuild_tensor_v2 (called)" in text
        assert "unknown" not in text and "not allowed" not in text
    assert "with 2 nested pickled payloads" in _describe(pickle.dumps(state))


def test_a_popped_global_is_still_reported_as_imported():
    data = PROTO2 + _global(SYS_MODULE, SYS_NAME) + pickle.POP + pickle.NONE + pickle.STOP
    text = _describe(data)
    assert f"importing {SYSTEM};" in text and "(called)" not in text


def test_the_refusal_names_what_the_opt_in_still_refuses():
    text = _describe(pickle.dumps(_Reduce(os.system, "true")))
    assert text.endswith(f"not allowed even inside fc.allow_unsafe_extra_state(): {SYSTEM}")


def test_unknown_when_a_global_comes_from_copyreg_extensions():
    data = PROTO2 + pickle.EXT1 + b"\x07" + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP
    text = _describe(data)
    assert "unknown" in text and "copyreg under code 7" in text


def test_unknown_when_a_persistent_reference_is_called():
    data = PROTO2 + pickle.NONE + pickle.BINPERSID + pickle.EMPTY_TUPLE + pickle.REDUCE + b"."
    assert "unknown: it calls a persistent reference" in _describe(data)


def test_unknown_when_a_global_object_is_changed():
    # BUILD on a global itself sets its attributes (a module's functions, say).
    data = PROTO2 + _global("os", "path") + pickle.EMPTY_DICT + pickle.BUILD + pickle.STOP
    text = _describe(data)
    assert "os.path (modified)" in text and "unknown: it changes os.path itself" in text


def test_encoding_dependent_strings_make_a_global_unknown():
    name = pickle.SHORT_BINSTRING + b"\x03\xe9vo"
    data = PROTO2 + name + _text("x") + pickle.STACK_GLOBAL + pickle.STOP
    assert "a global whose name is computed at load time" in _describe(data)


def test_a_malformed_pickle_still_names_what_runs_before_the_fault():
    data = PROTO2 + _global(SYS_MODULE, SYS_NAME) + _text("true") + pickle.TUPLE1
    data += pickle.REDUCE + b"\xff"
    report = pickles.inspect_pickle(data)
    assert f"{SYSTEM} (called)" in str(report)
    assert "malformed at byte" in str(report) and "unknown opcode 0xff" in str(report)
    # A benign but malformed pickle is refused before the restricted unpickler sees it.
    broken = pickle.dumps({"a": 1})[:-3]
    assert not pickles.inspect_pickle(broken).loadable
    with pytest.raises(ValueError, match="refusing to unpickle.*ends inside"):
        unpickling.unpickle(broken, "test", TE_ALLOW_LIST)


def test_every_pickle_entry_of_an_archive_is_read():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        archive.writestr("archive/extra.pkl", pickle.dumps(_Reduce(os.system, "true")))
    assert f"{SYSTEM} (called)" in _describe(out.getvalue())


def test_a_torchscript_archive_is_unknown():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        archive.writestr("archive/constants.pkl", pickle.dumps((), protocol=2))
    assert "TorchScript archive" in _describe(out.getvalue())


def test_a_corrupt_archive_is_unknown():
    data = bytearray(_torch_save({}))
    data[-30:] = b"\0" * 30  # the end of the central directory
    assert "unknown" in _describe(bytes(data))


# -- resource caps -------------------------------------------------------------------------------
def _timed_describe(payload):
    tracemalloc.start()
    try:
        start = time.perf_counter()
        text = pickles.describe_pickle(payload)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return text, elapsed, peak


def _memoize_bomb_archive(size: int) -> bytes:
    """A torch.save-like archive whose data.pkl is ``size`` bytes of MEMOIZE, deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("archive/version", b"3\n")
        with archive.open("archive/data.pkl", "w", force_zip64=True) as entry:
            entry.write(PROTO4 + pickle.EMPTY_DICT)
            chunk = pickle.MEMOIZE * (1 << 20)
            for _ in range(size >> 20):
                entry.write(chunk)
            entry.write(pickle.STOP)
    return out.getvalue()


@pytest.fixture(scope="module")
def memoize_bomb():
    return _memoize_bomb_archive(63 << 20)


def test_the_memoize_bomb_is_too_large_to_describe(memoize_bomb):
    assert len(memoize_bomb) < 100 << 10  # a small file...
    text, elapsed, peak = _timed_describe(memoize_bomb)  # ...of 63 MiB of opcodes
    assert "too large to describe" in text
    assert elapsed < 5 and peak < 100 << 20


def test_the_memoize_bomb_is_refused_in_and_out_of_the_opt_in(memoize_bomb):
    lin = fc.Linear(4, 4)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large to describe"):
        _load_extra(lin, io.BytesIO(memoize_bomb))
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match="too large to describe"):
        _load_extra(lin, torch.frombuffer(bytearray(memoize_bomb), dtype=torch.uint8))
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize(
    ("body", "cap"),
    [
        (pickle.MEMOIZE * (4 << 20), "memo entries"),  # under the byte cap
        ((pickle.NONE + pickle.POP) * (2 << 20), "opcodes"),
        (pickle.NONE * (20 << 20), "MiB of pickle"),  # over the byte cap
    ],
    ids=["memo", "opcodes", "bytes"],
)
def test_bare_pickle_bombs_are_too_large_to_describe(body, cap):
    data = PROTO4 + pickle.EMPTY_DICT + body + pickle.STOP
    text, elapsed, peak = _timed_describe(data)
    assert "too large to describe" in text and cap in text
    assert elapsed < 5 and peak < 100 << 20


def test_an_oversized_payload_is_not_even_read():
    huge = torch.zeros(65 << 20, dtype=torch.uint8)
    text, elapsed, peak = _timed_describe(huge)
    assert text == f"{65 << 20}-byte payload, too large to describe (over 64 MiB)"
    assert elapsed < 1 and peak < 1 << 20


def test_deep_nesting_is_too_large_to_describe():
    data = pickle.dumps(None)
    for _ in range(6):
        data = pickle.dumps(_Reduce(torch.storage._load_from_bytes, data))
    assert "too large to describe (payloads nested over 3 deep)" in _describe(data)


def test_an_archive_with_too_many_entries_is_too_large_to_describe():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for i in range(1100):
            archive.writestr(f"archive/{i}", b"")
    assert "over 1024 entries" in _describe(out.getvalue())


def test_a_deflated_entry_under_the_byte_cap_is_still_bounded():
    # 15 MiB of MEMOIZE is inflated and read, and stops at the memo cap.
    text, elapsed, peak = _timed_describe(_memoize_bomb_archive(15 << 20))
    assert "too large to describe (over 50000 memo entries)" in text
    assert elapsed < 5 and peak < 100 << 20


def test_an_oversized_archive_is_too_large_to_describe():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        archive.writestr("archive/data/0", bytes(17 << 20))
    assert "too large to describe (a zip archive over 16 MiB)" in _describe(out.getvalue())


def test_payload_bytes_reads_a_tensor_without_tolist():
    data = bytes(range(256)) * 4
    base = torch.frombuffer(bytearray(data * 2), dtype=torch.uint8)
    assert pickles.payload_bytes(base[len(data) :]) == data  # an offset view
    strided = base.view(2, -1)[:, :8].t()
    assert not strided.is_contiguous()
    assert pickles.payload_bytes(strided) == bytes(strided.reshape(-1).tolist())
    assert pickles.payload_bytes(torch.empty(0, dtype=torch.uint8)) == b""
    big = torch.zeros(64 << 20, dtype=torch.uint8)
    start = time.perf_counter()
    assert len(pickles.payload_bytes(big)) == 64 << 20
    assert time.perf_counter() - start < 2


# -- the restricted unpickler's own guards ------------------------------------------------------
def test_transformer_engine_classes_become_stand_ins_without_importing_it():
    data = PROTO2 + _global(TE_RECIPE_MODULE, "DelayedScaling") + pickle.EMPTY_TUPLE
    data += pickle.NEWOBJ + pickle.EMPTY_DICT + _text("margin") + pickle.NONE + pickle.SETITEM
    data += pickle.BUILD + pickle.STOP
    before = set(sys.modules)
    obj = unpickling.unpickle(data, "test", TE_ALLOW_LIST)
    assert type(obj) is TE_STAND_INS["DelayedScaling"] and obj.state == {"margin": None}
    assert not any(m.startswith("transformer_engine") for m in set(sys.modules) - before)


def test_other_transformer_engine_globals_are_refused():
    data = PROTO2 + _global(TE_RECIPE_MODULE, "CustomRecipe") + pickle.EMPTY_TUPLE
    data += pickle.REDUCE + pickle.STOP
    with pytest.raises(ValueError, match="CustomRecipe"):
        unpickling.unpickle(data, "test", TE_ALLOW_LIST)


@pytest.mark.parametrize(
    "target",
    [
        _global(TE_RECIPE_MODULE, "DelayedScaling"),
        _global("torch._utils", "_rebuild_tensor_v2"),
        _global("torch", "FloatStorage"),
    ],
    ids=["stand-in class", "function", "storage type"],
)
def test_allowed_globals_cannot_be_changed_by_build(target):
    # (None, {...}) is BUILD's slot state: setattr on the object itself.
    state = pickle.NONE + pickle.EMPTY_DICT + _text("__reduce__") + pickle.NONE + pickle.SETITEM
    data = PROTO2 + target + state + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    assert "unknown" in _describe(data)  # refused before loading...
    with pytest.raises((AttributeError, TypeError)):  # ...and unable to even so
        unpickling._RestrictedUnpickler(io.BytesIO(data), TE_ALLOW_LIST).load()
    assert TE_STAND_INS["DelayedScaling"].__reduce__ is not None
    assert TE_ALLOW_LIST.get("torch", "FloatStorage").dtype == torch.float32


def test_a_tensor_must_fit_its_storage():
    storage = unpickling._Storage(torch.UntypedStorage(8), torch.float32)
    assert unpickling._rebuild_tensor(storage, 0, (2,), (1,)).shape == (2,)
    cases = [(0, (3,), (1,)), (1, (2,), (1,)), (0, (2, 2), (1, 1)), (0, (1 << 26, 3), (0, 0))]
    for offset, size, stride in cases:  # the last: a stride-0 view claiming 200M elements
        with pytest.raises(pickle.UnpicklingError, match="past the end|storage holds"):
            unpickling._rebuild_tensor(storage, offset, size, stride)
    with pytest.raises(pickle.UnpicklingError, match="hooks"):
        unpickling._rebuild_tensor(storage, 0, (2,), (1,), False, {"hook": print})
    assert storage.untyped.nbytes() == 8


def test_plain_containers_and_python_2_spellings_load():
    value = {"a": [1, 2.0, None], "b": (True, "x"), "c": {3}, "d": frozenset({4})}
    for protocol in range(6):
        loaded = unpickling.unpickle(pickle.dumps(value, protocol=protocol), "test", TE_ALLOW_LIST)
        assert loaded == value


def test_the_allow_list_is_exact():
    # A near miss (another module, a dotted attribute path) is refused by name.
    for module, name in [
        ("collections", "OrderedDict.fromkeys"),
        ("builtins", "getattr"),
        ("torch", "load"),
        (TE_RECIPE_MODULE, "DelayedScaling.__init__"),
        ("functools", "partial"),
    ]:
        assert TE_ALLOW_LIST.get(module, name) is None
    assert TE_ALLOW_LIST.get("__builtin__", "set") is set  # Python 2's spelling


# -- the model against pickle itself ---------------------------------------------------------
class _Point:
    """A class with instance state: pickles as NEWOBJ/REDUCE then BUILD."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is _Point and (self.x, self.y) == (other.x, other.y)


_SAFE_GLOBALS = {
    ("builtins", "complex"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("builtins", "bytes"),
    ("builtins", "object"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
    ("copyreg", "_reconstructor"),
    ("copyreg", "__newobj__"),
    (__name__, "_Point"),
}


class _RecordingUnpickler(pickle.Unpickler):
    """pickle itself, resolving only the benign globals the generated trees use, and
    recording every global it is asked for (as the pickle spells it)."""

    def __init__(self, data):
        super().__init__(io.BytesIO(data))
        self.asked = []

    def find_class(self, module, name):
        self.asked.append((module, name))
        found = super().find_class(module, name)
        key = (found.__module__, found.__qualname__)
        if key not in _SAFE_GLOBALS and (module, name) not in _SAFE_GLOBALS:
            raise AssertionError(f"a generated pickle asked for {module}.{name}")
        return found


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.builds(bytearray, st.binary(max_size=8)),
)
_trees = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=3).map(collections.OrderedDict),
        st.frozensets(st.integers(), max_size=4),
        st.sets(st.text(max_size=3), max_size=4),
        st.builds(_Point, inner, inner),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(tree=_trees, protocol=st.integers(0, 5), shared=st.booleans())
def test_the_model_reads_every_benign_pickle_as_pickle_does(tree, protocol, shared):
    obj = [tree, tree] if shared else tree  # shared: the memo in use
    data = pickle.dumps(obj, protocol=protocol)
    ops = list(pickletools.genops(data))
    # Opcode for opcode: as many as pickletools reads, ending where it ends.
    report = pickles.PickleReport(len(data), "pickle")
    model = pickle_payloads._Model(report, None)
    end = pickle_machine._Machine(model, 0).run(data, 0, len(data))
    assert model.opcodes == len(ops) and end == ops[-1][2] + 1 == len(data)
    # What pickle imports is what the description lists, and nothing is unknown.
    unpickler = _RecordingUnpickler(data)
    assert unpickler.load() == obj
    expected = {
        ".".join(pickles._old_name(m, n) if protocol < 3 else (m, n)) for m, n in unpickler.asked
    }
    report = pickles.inspect_pickle(data)
    assert set(report.imports) == expected
    assert not (report.unknown or report.failures or report.too_large), str(report)


# Protocol 0 arguments are text; these bytes make up numbers, strings and near misses.
_ARG_BYTES = b"0123456789xXoObB_+-. \t\x00\x0b\x0c\reEinfaINFAL'\"\\"
_arg_lines = st.lists(st.sampled_from(list(_ARG_BYTES)), max_size=8).map(bytes)


def _pickle_accepts(data, **kwargs):
    try:
        pickle.loads(data, **kwargs)
    except Exception:  # noqa: BLE001 - any error: pickle stops there
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(opcode=st.sampled_from([b"I", b"L", b"F", b"S", b"V", b"Np", b"Np3\ng"]), line=_arg_lines)
def test_text_arguments_are_read_as_pickle_reads_them(opcode, line):
    data = opcode + line + b"\n."
    report = pickles.inspect_pickle(data)
    assume(not report.too_large)  # a PUT index past the memo cap: not described at all
    stopped = bool(report.failures)
    assert not report.unknown, str(report)
    # STRING is decoded with the loader's encoding; latin-1 never fails.
    assert stopped == (not _pickle_accepts(data, encoding="latin-1")), (data, str(report))


@pytest.mark.parametrize(
    "line",
    [b"0x10", b"010", b"1_0", b"-0b11", b"0o7", b" 12 ", b"12\x00junk", b"\x00", b"9" * 30],
)
def test_int_arguments_pickle_accepts_are_numbers(line):
    data = b"I" + line + b"\n" + pickle.POP + PROTO2 + _global(SYS_MODULE, SYS_NAME) + b"."
    assert _pickle_accepts(b"I" + line + b"\n.")
    assert f"importing {SYSTEM}" in _describe(data)


# -- what messages show --------------------------------------------------------------------------
def test_control_characters_in_names_are_escaped_in_every_message():
    hidden = "posix\x1b[2K\r"  # erase the line, return: a terminal would hide the name
    data = PROTO4 + _text(hidden) + _text("sys\u202etem") + pickle.STACK_GLOBAL
    data += _text("true") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
    lin = fc.Linear(4, 4)
    messages = []
    with pytest.raises(ValueError, match="refusing") as refused:
        _load_extra(lin, data)
    messages.append(str(refused.value))
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match="refusing") as opted:
        _load_extra(lin, data)
    messages.append(str(opted.value))
    with pytest.raises(pickle.UnpicklingError) as unpickler:
        unpickling._load_stream(data, TE_ALLOW_LIST)
    messages.append(str(unpickler.value))
    for message in messages:
        assert message.isprintable(), repr(message)
        assert "posix\\x1b[2K\\r.sys\\u202etem" in message


# -- amplification: bounded by what the payload holds --------------------------------------------
def test_encoding_a_memoized_text_in_a_loop_is_bounded():
    # Each loop is 8 bytes that encode 15 kB: 600 MB modelled from 240 kB without a budget.
    loop = _get(0) + _get(1) + _get(2) + pickle.TUPLE2 + pickle.REDUCE
    data = PROTO2 + _global("_codecs", "encode") + pickle.BINPUT + b"\x00"
    data += _text("x" * 15_000) + pickle.BINPUT + b"\x01" + _text("latin1") + pickle.BINPUT
    data += b"\x02" + loop * 30_000 + pickle.STOP
    assert len(data) < 256 << 10
    text, elapsed, peak = _timed_describe(data)
    assert "too large to describe" in text and "_codecs.encode" in text
    assert elapsed < 5 and peak < 100 << 20


def _rss_kib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


def _bounded(call, seconds=5, mib=100):
    """Run ``call`` and assert it stays within ``seconds`` and ``mib`` of new memory."""
    tracemalloc.start()
    rss = _rss_kib()
    start = time.perf_counter()
    try:
        call()
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < seconds and peak < mib << 20
    assert _rss_kib() - rss < mib << 10


def test_a_stride_0_history_is_refused_before_copying():
    history = torch.ones(1).expand(1 << 25, 3)  # 100M values claimed, 4 bytes held
    data = pickle.dumps({"scale_fwd": torch.ones(3), "amax_history_fwd": history})
    assert len(data) < 4096
    lin = fc.Linear(4, 4)

    def load():
        with fc.allow_unsafe_extra_state(), pytest.raises(ValueError, match="storage holds 1"):
            _load_extra(lin, data)

    _bounded(load)


def _tensor_given_a_state(claim):
    """A pickled tensor, then BUILD with (itself, 0, (claim,), (1,)): Tensor.__setstate__
    would call set_ and grow the storage to ``claim`` elements."""
    data = pickle.dumps(torch.ones(2), protocol=2)[:-1] + pickle.BINPUT + b"\xc8"
    state = pickle.MARK + pickle.BINGET + b"\xc8" + pickle.BININT1 + b"\x00"
    state += pickle.BININT + struct.pack("<i", claim) + pickle.TUPLE1
    state += pickle.BININT1 + b"\x01" + pickle.TUPLE1 + pickle.TUPLE
    return data + state + pickle.BUILD + pickle.STOP


def test_a_tensor_given_a_state_is_refused():
    data = _tensor_given_a_state(1 << 27)
    lin = fc.Linear(4, 4)

    def load():
        with (
            fc.allow_unsafe_extra_state(),
            pytest.raises(
                ValueError, match=r"sets the state of a torch._utils._rebuild_tensor_v2 object"
            ),
        ):
            _load_extra(lin, data)
        # Below the description, the unpickler refuses it too.
        with pytest.raises(pickle.UnpicklingError, match="tensor given a state"):
            unpickling._load_stream(data, TE_ALLOW_LIST)

    _bounded(load)


def test_a_compressed_storage_is_refused():
    source = zipfile.ZipFile(io.BytesIO(_torch_save(torch.zeros(8 << 20)[:2])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info))
    data = out.getvalue()
    assert len(data) < 1 << 20  # 32 MiB of storage behind a view of two values
    with pytest.raises(pickle.UnpicklingError, match="compressed"):
        unpickling._load_archive(data, TE_ALLOW_LIST)


# -- loaded state is plain data ------------------------------------------------------------------
def test_loaded_tensors_take_no_part_in_autograd():
    state = {
        "scale_fwd": torch.ones(3, requires_grad=True),
        "amax_history_fwd": torch.ones(4, 3, requires_grad=True),
        "scale_bwd": torch.ones(2, requires_grad=True),
        "amax_history_bwd": torch.ones(4, 2, requires_grad=True),
    }
    lin = fc.Linear(16, 16)
    with fc.allow_unsafe_extra_state():
        _load_extra(lin, pickle.dumps(state))
    # Scales that required grad would grow a graph with every in-place update.
    assert lin._scheme_state.keys() == {0, 1}
    for meta in lin._scheme_state.values():
        for tensor in (meta.scale, meta.history):
            assert not tensor.requires_grad and tensor.grad_fn is None


def test_an_ordered_dict_given_its_own_get_is_refused_naming_the_module():
    data = PROTO2 + _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    data += pickle.EMPTY_DICT + _text("get") + _global("builtins", "set") + pickle.SETITEM
    data += pickle.BUILD + _text("scale_fwd") + pickle.NONE + pickle.SETITEM + pickle.STOP
    lin = fc.Linear(4, 4)
    with fc.allow_unsafe_extra_state(), pytest.raises(ValueError) as refused:
        _load_extra(lin, data)
    assert "fc.Linear" in str(refused.value) and "OrderedDict" in str(refused.value)
    with pytest.raises(pickle.UnpicklingError, match="OrderedDict given a state"):
        unpickling._load_stream(data, TE_ALLOW_LIST)
