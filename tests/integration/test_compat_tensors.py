"""The tensor family of ``MooncakeDistributedStore``: the same script on the wheel and on ours.

:data:`TENSORS` runs against the published wheel (its scratch venv needs CPU torch and
safetensors: ``scripts/setup_mooncake_peer.sh --torch``) and against ours; both must give
:data:`EXPECTED`, which was taken from the wheel (0.3.13.post1). It compares return codes,
the tensors read back (dtype, shape, a hash of the bytes), and the hash of each tensor
object's raw bytes, so ours writes the published object format byte for byte.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_compat_parity as parity
import test_compat_store as harness

torch = pytest.importorskip("torch")

from mooncake_core.compat import tensor_format  # noqa: E402
from mooncake_core.compat.store import MooncakeDistributedStore  # noqa: E402
from mooncake_core.store import MasterServer  # noqa: E402

TENSORS = (
    parity.PRELUDE
    + """
import hashlib, tempfile
import torch
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, metadata = sys.argv[1], sys.argv[2]
r = {}

def desc(t):
    if t is None:
        return None
    c = t.contiguous()
    return [str(t.dtype), list(t.shape),
            hashlib.sha256(c.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]]

def raw(k):
    b = s.get(k)
    return [len(b), hashlib.sha256(b).hexdigest()[:16]]

s = MooncakeDistributedStore()
r["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
base = torch.arange(24).reshape(2, 3, 4)
for name in ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16",
             "int32", "uint32", "int64", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
             "complex64"]:
    dt = getattr(torch, name)
    t = torch.zeros(2, dtype=dt) if name == "complex64" else (base % 7).to(dt)
    k = "dt_" + name
    rc = s.put_tensor(k, t)
    r[k] = [rc, desc(s.get_tensor(k)), raw(k) if rc == 0 else None]
r["scalar"] = [s.put_tensor("scalar", torch.tensor(3.5)), desc(s.get_tensor("scalar")), raw("scalar")]
r["empty"] = [s.put_tensor("empty", torch.zeros(0, 5)), desc(s.get_tensor("empty")), raw("empty")]
r["8d"] = [s.put_tensor("8d", torch.ones([1] * 8)), desc(s.get_tensor("8d"))]
r["9d"] = s.put_tensor("9d", torch.ones([1] * 9))
r["noncontig"] = [s.put_tensor("nc", base.transpose(0, 2)), desc(s.get_tensor("nc")) == desc(base.transpose(0, 2))]
r["not_tensor"] = [s.put_tensor("nt", [1, 2]), s.is_exist("nt")]
s.put("rawbytes", b"not a tensor at all")
r["get_raw_as_tensor"] = desc(s.get_tensor("rawbytes"))
r["get_missing"] = desc(s.get_tensor("missing"))
r["put_existing"] = [s.put_tensor("dt_float32", torch.ones(1)), desc(s.get_tensor("dt_float32"))[1]]
r["upsert"] = [s.upsert_tensor("dt_float32", torch.ones(1)), desc(s.get_tensor("dt_float32"))]
r["batch_put"] = s.batch_put_tensor(["b1", "b2"], [base.float(), base.half()])
r["batch_put_mismatch"] = s.batch_put_tensor(["b3", "b4"], [base])
r["batch_put_bad"] = s.batch_put_tensor(["b5", "b6"], [base, "x"])
r["batch_put_bad_exist"] = [s.is_exist("b5"), s.is_exist("b6")]
r["batch_get"] = [desc(t) for t in s.batch_get_tensor(["b1", "nope", "b2", "rawbytes"])]
r["batch_upsert"] = s.batch_upsert_tensor(["b1", "b7"], [base.int(), base.double()])
r["batch_upsert_get"] = [desc(t) for t in s.batch_get_tensor(["b1", "b7"])]
w = torch.arange(48, dtype=torch.float32).reshape(4, 12)
r["tp"] = [s.put_tensor_with_tp("w", w, tp_rank=0, tp_size=3, split_dim=1),
           [s.is_exist(k) for k in ["w", "w_tp_0", "w_tp_1", "w_tp_2", "w_tp_3"]],
           [raw("w_tp_%d" % i) for i in range(3)],
           [desc(s.get_tensor_with_tp("w", i, 3, 1)) == desc(w[:, 4 * i: 4 * i + 4]) for i in range(3)]]
r["tp_size1"] = [s.put_tensor_with_tp("w1", w), s.is_exist("w1"), s.is_exist("w1_tp_0"), raw("w1")]
r["tp_size0"] = [s.put_tensor_with_tp("w0", w, tp_size=0), s.is_exist("w0")]
r["tp_uneven"] = [s.put_tensor_with_tp("wu", torch.zeros(5, 7), tp_size=3, split_dim=1), s.is_exist("wu_tp_0")]
r["tp_too_many"] = [s.put_tensor_with_tp("wm", w, tp_size=8, split_dim=0), s.is_exist("wm_tp_0")]
r["tp_bad_dim"] = s.put_tensor_with_tp("wd", w, tp_size=2, split_dim=5)
r["tp_get_oob"] = desc(s.get_tensor_with_tp("w", tp_rank=5, tp_size=3))
r["tp_get_other_size"] = desc(s.get_tensor_with_tp("w", tp_rank=0, tp_size=1))
r["tp_batch"] = s.batch_put_tensor_with_tp(["p", "q", "bad"], [w, w * 2, torch.zeros(3)], tp_size=2)
r["tp_batch_get"] = [desc(t) for t in s.batch_get_tensor_with_tp(["p", "q", "bad"], tp_rank=1, tp_size=2)]
n = 1 << 16
buf = (ctypes.c_char * n)()
p = ctypes.addressof(buf)
r["reg"] = s.register_buffer(p, n)
t = s.get_tensor_into("w1", p, n)
r["into"] = [desc(t), t.data_ptr() - p, ctypes.string_at(p, 304 + 192) == s.get("w1")]
t[0, 0] = 99.0
r["into_shares"] = ctypes.string_at(p + 304, 4) == torch.tensor([99.0]).numpy().tobytes()
r["into_small"] = desc(s.get_tensor_into("w1", p, 100))
r["into_missing"] = desc(s.get_tensor_into("nope", p, n))
size = s.get_size("w1")
r["from"] = [s.put_tensor_from("f1", p, size), desc(s.get_tensor("f1"))]
r["from_short"] = [s.put_tensor_from("f2", p, 200), s.is_exist("f2")]
ctypes.memmove(p + 2000, b"garbage!" * 100, 800)
r["from_garbage"] = [s.put_tensor_from("f3", p + 2000, 600), s.is_exist("f3")]
r["upsert_from"] = [s.upsert_tensor_from("f1", p, size), s.batch_upsert_tensor_from(["f1", "f4"], [p, p], [size, size])]
r["batch_from"] = s.batch_put_tensor_from(["f5", "f6"], [p, p + 2000], [size, 600])
q = p + 20000
res = s.batch_get_tensor_into(["f5", "nope", "w1"], [q, q + 5000, q + 10000], [5000, 5000, 5000])
r["batch_into"] = [desc(x) for x in res]
r["tp_from"] = [s.put_tensor_with_tp_from("tf", p, size, tp_rank=0, tp_size=2, split_dim=1),
                [s.is_exist(k) for k in ["tf", "tf_tp_0", "tf_tp_1"]], raw("tf_tp_1")]
r["tp_from_1"] = [s.put_tensor_with_tp_from("tg", p, size), s.is_exist("tg")]
r["tp_from_garbage"] = s.put_tensor_with_tp_from("th", p + 2000, 600, tp_size=2)
r["tp_from_batch"] = [s.batch_put_tensor_with_tp_from(["b8", "b9"], [p, p], [size, size], tp_size=4, split_dim=0),
                      [s.is_exist("b9_tp_%d" % i) for i in range(5)]]
y = s.get_tensor_with_tp_into("tf", q, 20000, tp_rank=1, tp_size=2, split_dim=1)
r["tp_into"] = [desc(y), y.data_ptr() - q]
r["tp_into_1"] = desc(s.get_tensor_with_tp_into("tg", q, 20000))
ys = s.batch_get_tensor_with_tp_into(["b8", "b9", "nope"], [q, q + 5000, q + 10000], [5000] * 3, tp_rank=3, tp_size=4)
r["tp_batch_into"] = [desc(y) for y in ys]
meta = (ctypes.c_char * 64)()
ctypes.memmove(meta, b"M" * 64, 64)
r["with_metadata"] = [s.put_from_with_metadata("wm1", p, ctypes.addressof(meta), 100, 50),
                      s.get_size("wm1"),
                      s.get("wm1") == b"M" * 50 + ctypes.string_at(p, 100)]
d = tempfile.mkdtemp()
f = os.path.join(d, "x.safetensors")
r["save"] = [s.save_tensor_to_safetensor("b2", f), os.path.getsize(f)]
r["save_missing"] = s.save_tensor_to_safetensor("nope", os.path.join(d, "n.safetensors"))
r["save_raw"] = s.save_tensor_to_safetensor("rawbytes", os.path.join(d, "r.safetensors"))
r["save_default_name"] = [s.save_tensor_to_safetensor("b1") if os.chdir(d) is None else None, sorted(os.listdir(d))]
r["load"] = desc(s.load_tensor_from_safetensor(file_name=f))
r["load_key"] = [desc(s.load_tensor_from_safetensor("ld", f)), desc(s.get_tensor("ld"))]
r["load_missing"] = desc(s.load_tensor_from_safetensor(file_name=os.path.join(d, "none")))
try:
    s.load_tensor_from_safetensor("ld")
    r["load_no_file"] = "ok"
except TypeError:
    r["load_no_file"] = "TypeError"
r["pub"] = [s.put_tensor("pa", w), s.pub_tensor("pb", w), raw("pa") == raw("pb")]
c2 = ReplicateConfig()
c2.replica_num = 2
r["pub_two_replicas"] = [s.pub_tensor("pc", w, c2), len(s.get_replica_desc("pc"))]
bad = ReplicateConfig()
bad.soft_pin_ttl_ms = 5
r["pub_bad_config"] = [s.pub_tensor("pd", w, bad), s.batch_pub_tensor(["pe"], [w], bad),
                       s.pub_tensor_with_tp("pf", w, bad, tp_size=2), s.upsert_pub_tensor("pa", w, bad)]
r["pub_again"] = [s.pub_tensor("pb", w * 2), desc(s.get_tensor("pb")) == desc(w)]
r["upsert_pub"] = [s.upsert_pub_tensor("pb", w * 2), desc(s.get_tensor("pb")) == desc(w * 2)]
r["pub_not_tensor"] = s.pub_tensor("pg", [1])
r["batch_pub"] = s.batch_pub_tensor(["ph", "pi"], [w, "x"])
r["batch_upsert_pub"] = [s.batch_upsert_pub_tensor(["ph", "pj"], [w * 3, w]),
                         desc(s.get_tensor("ph")) == desc(w * 3)]
r["pub_tp"] = [s.pub_tensor_with_tp("pk", w, tp_size=2, split_dim=1), raw("pk_tp_1") == raw("tf_tp_1")]
r["batch_pub_tp"] = [s.batch_pub_tensor_with_tp(["pl", "pm"], [w, torch.zeros(3)], tp_size=2, split_dim=0),
                     s.is_exist("pl_tp_1")]
# the *_with_parallelism family: the keys and bytes written, the tensors read back
from mooncake.store import ParallelAxis, TensorParallelism, ReadTarget
def ax(kind, rank, size, split_dim=None, expert_id=None, stage_id=None):
    a = ParallelAxis()
    a.kind, a.rank, a.size = kind, rank, size
    a.split_dim, a.expert_id, a.stage_id = split_dim, expert_id, stage_id
    return a
def par(*axes):
    t = TensorParallelism()
    t.axes = list(axes)
    return t
def rt(mode, p=None):
    t = ReadTarget()
    t.mode = mode
    t.parallelism = p
    return t
def keys(prefix, names):
    return [n for n in names if s.is_exist(prefix + n) == 1]
rc = ReplicateConfig()
x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
r["par_types"] = [[a.kind, a.rank, a.size, a.split_dim, a.expert_id, a.stage_id] for a in [ParallelAxis()]]
r["par_types"] += [TensorParallelism().axes, ReadTarget().mode, ReadTarget().parallelism]
for name, fn in [("kind_int", lambda: setattr(ParallelAxis(), "kind", 1)),
                 ("rank_none", lambda: setattr(ParallelAxis(), "rank", None)),
                 ("axes_str", lambda: setattr(TensorParallelism(), "axes", "x")),
                 ("mode_bad", lambda: setattr(ReadTarget(), "mode", "sideways")),
                 ("mode_int", lambda: setattr(ReadTarget(), "mode", 1))]:
    try:
        fn()
        r["par_type_" + name] = "ok"
    except Exception as e:
        r["par_type_" + name] = type(e).__name__
t0 = ReadTarget(); t0.mode = "FULL"
r["par_mode_case"] = t0.mode
r["par_tp"] = [s.put_tensor_with_parallelism("pt", x[:2], par(ax("tp", 0, 2, 0))),
               s.put_tensor_with_parallelism("pt", x[2:], par(ax("TP", 1, 2, 0))),
               keys("pt", ["", "_tp_0", "_tp_1", "__parallelism_manifest"]),
               raw("pt_tp_1"), raw("pt__parallelism_manifest")]
r["par_dp_pp_ep"] = [s.put_tensor_with_parallelism("pd", x, par(ax("dp", 1, 2))),
                     s.put_tensor_with_parallelism("pp", x, par(ax("pp", 1, 4, stage_id=3))),
                     s.put_tensor_with_parallelism("pe", x, par(ax("ep", 1, 2, expert_id=5))),
                     s.put_tensor_with_parallelism("pm", x, par(ax("pp", 1, 2, stage_id=0), ax("ep", 0, 2, expert_id=3))),
                     raw("pd__dp_1of2"), raw("pp__pp_1of4_sid3"), raw("pe__ep_1of2_eid5"),
                     raw("pm__ep_0of2_eid3__pp_1of2_sid0")]
r["par_refused"] = [s.put_tensor_with_parallelism("pr", x, p_) for p_ in [
    par(ax("pp", 1, 2)), par(ax("ep", 1, 2)), par(ax("ep", 1, 2, 0, expert_id=1)),
    par(ax("dp", 0, 2), ax("tp", 0, 2, 1)), par(ax("tp", 0, 2)), par(ax("zz", 0, 2, 0)), par(),
    par(ax("tp", 2, 2, 0)), par(ax("tp", 0, 2, 5)), par(ax("tp", 0, 0, 0)),
    par(ax("tp", 0, 2, 0), ax("tp", 0, 2, 1)), par(ax("dp", 0, 2, 1)), {"axes": []}]]
r["par_refused"] += [s.put_tensor_with_parallelism("pr", x, par(ax("tp", 0, 2, 0)), rc, ax("tp", 0, 2, 0)),
                     s.put_tensor_with_parallelism("pr", torch.tensor(3.0), par(ax("tp", 0, 2, 0))),
                     s.put_tensor_with_parallelism("pr", x, None, rc, {"rank": 0, "size": 2, "split_dim": 0}),
                     s.put_tensor_with_parallelism("pr", x, None, rc, ax("tp", 1, 4, 1)),
                     s.put_tensor_with_parallelism("pr", x, par(ax("dp", 0, 2)), bad),
                     s.is_exist("pr")]
dt = lambda r_: par(ax("dp", 0, 2), ax("tp", r_, 2, 1))
r["par_multi"] = [s.put_tensor_with_parallelism("pq", x, dt(0)), s.put_tensor_with_parallelism("pq", x, dt(1)),
                  keys("pq", ["__dp_0of2__tp_0of2_sd1", "__dp_0of2__tp_1of2_sd1", "__parallelism_manifest"]),
                  raw("pq__dp_0of2__tp_1of2_sd1"), raw("pq__parallelism_manifest"),
                  desc(s.get_tensor_with_parallelism("pq", rt("shard", dt(1)))),
                  desc(s.get_tensor_with_parallelism("pq", rt("full", dt(0)))),
                  s.put_tensor_with_parallelism("pq2", x, par(ax("tp", 1, 2, 0), ax("pp", 0, 2, stage_id=1))),
                  raw("pq2__tp_1of2_sd0__pp_0of2_sid1")]
r["par_writer"] = [s.put_tensor_with_parallelism("pw", x, None, rc, ax("tp", r_, 2, 1)) for r_ in (0, 1)]
r["par_writer"] += [keys("pw", ["__writer_0of2_sd1", "__writer_1of2_sd1", "__writer_manifest"]),
                    raw("pw__writer_1of2_sd1"), raw("pw__writer_manifest")]
r["par_plain"] = [s.put_tensor_with_parallelism("pn", x), raw("pn") == [s.put_tensor("pn2", x), raw("pn2")][1]]
reads = {
    "pt": [None, rt("as_stored"), rt("full"), rt("shard"), rt("full", par(ax("tp", 1, 2, 0))),
           rt("shard", par(ax("tp", 1, 2, 0))), rt("shard", par(ax("tp", 1, 4, 0))),
           rt("shard", par(ax("tp", 0, 1, 0))), rt("shard", par(ax("tp", 1, 3, 0))),
           rt("full", par(ax("tp", 1, 3, 0))), rt("full", par(ax("tp", 0, 2, 1))),
           rt("full", par(ax("dp", 0, 2))), rt("as_stored", par(ax("tp", 1, 2, 0)))],
    "pd": [None, rt("full"), rt("shard", par(ax("dp", 1, 2))), rt("shard", par(ax("dp", 0, 2)))],
    "pm": [rt("shard", par(ax("ep", 0, 2, expert_id=3), ax("pp", 1, 2, stage_id=0))),
           rt("shard", par(ax("pp", 1, 2, stage_id=0)))],
    "pw": [None, rt("full"), rt("shard", par(ax("tp", 1, 2, 1))), rt("shard", par(ax("tp", 1, 2, 0))),
           rt("full", par(ax("tp", 0, 2, 1)))],
    "pn": [None, rt("full"), rt("shard", par(ax("tp", 1, 2, 0)))],
    "b1": [rt("shard", par(ax("tp", 1, 2, 1))), rt("full", par(ax("tp", 0, 2, 1)))],
    "nope": [None, rt("full", par(ax("tp", 0, 2, 0)))],
}
r["par_reads"] = {k: [desc(s.get_tensor_with_parallelism(k, t_)) for t_ in ts] for k, ts in reads.items()}
r["par_read_bad_target"] = [desc(s.get_tensor_with_parallelism("pt", "full"))]
r["par_batch_get"] = [[desc(y) for y in s.batch_get_tensor_with_parallelism(["pn", "pt", "nope"], t_)]
                      for t_ in [None, [None, rt("full", par(ax("tp", 0, 2, 0))), None], [None]]]
q2 = p + 40000
y = s.get_tensor_with_parallelism_into("pt", q2, 4096, rt("shard", par(ax("tp", 1, 4, 0))))
r["par_into"] = [desc(y), y.data_ptr() - q2, ctypes.string_at(q2, 304) == s.get("pt_tp_1")[:304]]
y = s.get_tensor_with_parallelism_into("pt", q2, 4096, rt("full", par(ax("tp", 1, 2, 0))))
r["par_into"] += [desc(y), ctypes.string_at(q2, 400) == s.get("pn")]
y = s.get_tensor_with_parallelism_into("pt", q2, 4096, rt("shard", par(ax("tp", 1, 2, 0))))
r["par_into"] += [ctypes.string_at(q2, 352) == s.get("pt_tp_1"),
                  desc(s.get_tensor_with_parallelism_into("pt", q2, 100, rt("full", par(ax("tp", 1, 2, 0))))),
                  desc(s.get_tensor_with_parallelism_into("nope", q2, 4096))]
r["par_batch_into"] = [desc(y) for y in s.batch_get_tensor_with_parallelism_into(
    ["pt", "pn"], [q2, q2 + 2048], [2048, 2048], [rt("full", par(ax("tp", 0, 2, 0))), None])]
s.get_tensor_into("pn", q2, 4096)
r["par_from"] = [s.put_tensor_with_parallelism_from("pf", q2, 400, par(ax("tp", 0, 2, 0))),
                 keys("pf", ["", "_tp_0", "_tp_1", "__parallelism_manifest"]), raw("pf_tp_1"),
                 s.put_tensor_with_parallelism_from("pf2", q2, 400), raw("pf2") == raw("pn"),
                 s.put_tensor_with_parallelism_from("pf3", q2, 400, None, rc, ax("tp", 1, 2, 0)),
                 raw("pf3__writer_1of2_sd0"),
                 s.put_tensor_with_parallelism_from("pf4", q2, 400, par(ax("dp", 0, 2))), raw("pf4__dp_0of2"),
                 s.put_tensor_with_parallelism_from("pf5", q2 + 500, 400, par(ax("tp", 0, 2, 0)))]
r["par_upsert"] = [s.put_tensor_with_parallelism("pt", x[2:] * 10, par(ax("tp", 1, 2, 0))),
                   desc(s.get_tensor("pt_tp_1")),
                   s.upsert_tensor_with_parallelism("pt", x[2:] * 10, par(ax("tp", 1, 2, 0))),
                   desc(s.get_tensor_with_parallelism("pt", rt("full", par(ax("tp", 0, 2, 0))))),
                   s.upsert_tensor_with_parallelism_from("pf2", q2, 400, par(ax("dp", 1, 2))),
                   raw("pf2__dp_1of2")]
r["par_batch_put"] = [
    s.batch_put_tensor_with_parallelism(["q1", "q2"], [x[:2], x[:, :3]], [par(ax("tp", 0, 2, 0)), par(ax("tp", 0, 2, 1))]),
    s.batch_put_tensor_with_parallelism(["q3", "q4"], [x, x]),
    s.batch_put_tensor_with_parallelism(["q5", "q6"], [x, x], [par(ax("tp", 0, 2, 0))]),
    s.batch_put_tensor_with_parallelism(["q7", "q8"], [x, x], None, rc, [ax("tp", 0, 2, 0), ax("tp", 1, 2, 0)]),
    s.batch_put_tensor_with_parallelism(["q9", "q10"], [x, x], [par(ax("tp", 0, 2, 0)), par(ax("zz", 0, 2, 0))]),
    s.batch_put_tensor_with_parallelism(["q11"], [x, x]),
    s.batch_put_tensor_with_parallelism(["q12"], [x], [par(ax("dp", 0, 2))], rc, [ax("tp", 0, 2, 0)]),
    s.batch_put_tensor_with_parallelism(["q13", "q14"], [x, x], None, rc, [ax("tp", 0, 2, 0)]),
    s.batch_upsert_tensor_with_parallelism(["q3"], [x * 2], [par(ax("dp", 0, 2))]),
    s.batch_put_tensor_with_parallelism_from(["q15", "q16"], [q2, q2 + 500], [400, 400], [par(ax("dp", 0, 2))] * 2),
    s.batch_upsert_tensor_with_parallelism_from(["q15"], [q2], [400], [par(ax("dp", 0, 2))]),
    [s.is_exist(k) for k in ["q1_tp_0", "q2_tp_0", "q3", "q4", "q5", "q7__writer_0of2_sd0",
                             "q8__writer_1of2_sd0", "q9_tp_0", "q10", "q3__dp_0of2", "q15__dp_0of2"]]]
for name, fn in [("key_int", lambda: s.put_tensor_with_parallelism(5, x)),
                 ("config_str", lambda: s.put_tensor_with_parallelism("pz", x, None, "x")),
                 ("not_tensor", lambda: s.put_tensor_with_parallelism("pz", b"x", par(ax("tp", 0, 2, 0))))]:
    try:
        r["par_call_" + name] = fn()
    except Exception as e:
        r["par_call_" + name] = type(e).__name__
r["unreg"] = s.unregister_buffer(p)
s.close()
print(json.dumps(r))
"""  # noqa: E501 - the script as a user writes it
)

# fmt: off
EXPECTED: dict[str, Any] = {'setup': 0,
 'dt_float32': [0, ['torch.float32', [2, 3, 4], '0d7be92b5fb53cff'], [400, 'f0077f7828b55bfc']],
 'dt_float64': [0, ['torch.float64', [2, 3, 4], '07cda91cd942d043'], [496, '0be0894d71bc229b']],
 'dt_float16': [0, ['torch.float16', [2, 3, 4], '799dd66c6b384331'], [352, '8cbbcc7019e6f9a2']],
 'dt_bfloat16': [0, ['torch.bfloat16', [2, 3, 4], 'dd2b5f67a92fba89'], [352, '6cdb24d548037b98']],
 'dt_int8': [0, ['torch.int8', [2, 3, 4], '53acdf25255f7e4e'], [328, '56ddc82a85c3f669']],
 'dt_uint8': [0, ['torch.uint8', [2, 3, 4], '53acdf25255f7e4e'], [328, 'bcebec89aff026fa']],
 'dt_int16': [0, ['torch.int16', [2, 3, 4], 'ad756f06cdf0aba4'], [352, '4577a2706f6a4264']],
 'dt_uint16': [0, ['torch.uint16', [2, 3, 4], 'ad756f06cdf0aba4'], [352, '54dcc5bf65136790']],
 'dt_int32': [0, ['torch.int32', [2, 3, 4], '40a6d0f4e5947c5d'], [400, '4cbf0541c31576ee']],
 'dt_uint32': [0, ['torch.uint32', [2, 3, 4], '40a6d0f4e5947c5d'], [400, '32079ce2a270dd00']],
 'dt_int64': [0, ['torch.int64', [2, 3, 4], 'dcc30cdaa8757141'], [496, 'b9cefab3bf9a4de0']],
 'dt_uint64': [0, ['torch.uint64', [2, 3, 4], 'dcc30cdaa8757141'], [496, 'bce806118eb41138']],
 'dt_bool': [0, ['torch.bool', [2, 3, 4], '393e651874e19037'], [328, '34c80f90effff59d']],
 'dt_float8_e4m3fn': [0,
                      ['torch.float8_e4m3fn', [2, 3, 4], '7522ae36617602fc'],
                      [328, '82345fbc4215a576']],
 'dt_float8_e5m2': [0,
                    ['torch.float8_e5m2', [2, 3, 4], '1520e842c2169165'],
                    [328, 'b9ecf3908612c664']],
 'dt_complex64': [-600, None, None],
 'scalar': [0, ['torch.float32', [1], 'e21712a06022eeca'], [308, 'b95b6a52410be272']],
 'empty': [0, ['torch.float32', [0, 5], 'e3b0c44298fc1c14'], [304, '206443b903f29bf6']],
 '8d': [0, ['torch.float32', [1, 1, 1, 1, 1, 1, 1, 1], 'e00e5eb9444182f3']],
 '9d': -600,
 'noncontig': [0, True],
 'not_tensor': [-600, 0],
 'get_raw_as_tensor': None,
 'get_missing': None,
 'put_existing': [0, [2, 3, 4]],
 'upsert': [0, ['torch.float32', [1], 'e00e5eb9444182f3']],
 'batch_put': [0, 0],
 'batch_put_mismatch': [-600, -600],
 'batch_put_bad': [0, -600],
 'batch_put_bad_exist': [1, 0],
 'batch_get': [['torch.float32', [2, 3, 4], '45a99655901702d5'],
               None,
               ['torch.float16', [2, 3, 4], '40e4f6e29a2f373b'],
               None],
 'batch_upsert': [0, 0],
 'batch_upsert_get': [['torch.int32', [2, 3, 4], 'a26f2589bc817e20'],
                      ['torch.float64', [2, 3, 4], '83e13c83f17cec9f']],
 'tp': [0,
        [0, 1, 1, 1, 0],
        [[368, '8301af6c8ffc7e5a'], [368, '0cf93cb12f8cce0a'], [368, '52a14fc9b8fb1a4a']],
        [True, True, True]],
 'tp_size1': [0, 1, 0, [496, '7000ea12f7539eda']],
 'tp_size0': [0, 1],
 'tp_uneven': [-600, 0],
 'tp_too_many': [-600, 0],
 'tp_bad_dim': -600,
 'tp_get_oob': None,
 'tp_get_other_size': None,
 'tp_batch': [0, 0, -600],
 'tp_batch_get': [['torch.float32', [2, 12], '50fb44673c4123b8'],
                  ['torch.float32', [2, 12], 'b777ae08c2d5e66e'],
                  None],
 'reg': 0,
 'into': [['torch.float32', [4, 12], '77135df9eb160bde'], 304, True],
 'into_shares': True,
 'into_small': None,
 'into_missing': None,
 'from': [0, ['torch.float32', [4, 12], '0e1cae6f7c462c17']],
 'from_short': [-600, 0],
 'from_garbage': [-600, 0],
 'upsert_from': [0, [0, 0]],
 'batch_from': [-600, -600],
 'batch_into': [None, None, ['torch.float32', [4, 12], '77135df9eb160bde']],
 'tp_from': [0, [0, 1, 1], [400, '85262331982c263d']],
 'tp_from_1': [0, 1],
 'tp_from_garbage': -600,
 'tp_from_batch': [[0, 0], [1, 1, 1, 1, 0]],
 'tp_into': [['torch.float32', [4, 6], 'e30f5c110481b828'], 304],
 'tp_into_1': ['torch.float32', [4, 12], '0e1cae6f7c462c17'],
 'tp_batch_into': [['torch.float32', [1, 12], 'ab7166287d458c78'],
                   ['torch.float32', [1, 12], 'ab7166287d458c78'],
                   None],
 'with_metadata': [0, 150, True],
 'save': [0, 120],
 'save_missing': -1100,
 'save_raw': -1100,
 'save_default_name': [0, ['b1', 'x.safetensors']],
 'load': ['torch.float16', [2, 3, 4], '40e4f6e29a2f373b'],
 'load_key': [['torch.float16', [2, 3, 4], '40e4f6e29a2f373b'],
              ['torch.float16', [2, 3, 4], '40e4f6e29a2f373b']],
 'load_missing': None,
 'load_no_file': 'TypeError',
 'pub': [0, 0, True],
 'pub_two_replicas': [0, 1],
 'pub_bad_config': [-600, [-600], -600, -600],
 'pub_again': [0, True],
 'upsert_pub': [0, True],
 'pub_not_tensor': -600,
 'batch_pub': [0, -600],
 'batch_upsert_pub': [[0, 0], True],
 'pub_tp': [0, True],
 'batch_pub_tp': [[0, -600], 1],
 'par_types': [['', 0, 1, None, None, None], [], 'as_stored', None],
 'par_type_kind_int': 'TypeError',
 'par_type_rank_none': 'TypeError',
 'par_type_axes_str': 'TypeError',
 'par_type_mode_bad': 'RuntimeError',
 'par_type_mode_int': 'TypeError',
 'par_mode_case': 'full',
 'par_tp': [0,
            0,
            ['_tp_0', '_tp_1', '__parallelism_manifest'],
            [352, '92d1b867a8fd2939'],
            [96, 'b1312a05673472a4']],
 'par_dp_pp_ep': [0,
                  0,
                  0,
                  0,
                  [400, '2839c29aca88a4fb'],
                  [400, '22b6d2a775235856'],
                  [400, 'ea886ddd344ca4d1'],
                  [400, '11950b2ee573c165']],
 'par_refused': [-600,
                 -600,
                 -600,
                 0,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 -600,
                 0],
 'par_multi': [0,
               0,
               ['__dp_0of2__tp_0of2_sd1', '__dp_0of2__tp_1of2_sd1', '__parallelism_manifest'],
               [352, 'e647fb614cb1de44'],
               [96, 'be901b35ba3bc6ac'],
               ['torch.float32', [4, 3], 'bd1189ecbfc4fc07'],
               ['torch.float32', [4, 6], '45a99655901702d5'],
               0,
               [352, 'f0d86bb8de4a9580']],
 'par_writer': [0,
                0,
                ['__writer_0of2_sd1', '__writer_1of2_sd1', '__writer_manifest'],
                [352, '7553d3ac0f90fcf3'],
                [96, 'be901b35ba3bc6ac']],
 'par_plain': [0, True],
 'par_reads': {'pt': [None,
                      None,
                      None,
                      None,
                      ['torch.float32', [4, 6], '45a99655901702d5'],
                      ['torch.float32', [2, 6], 'b38a7cbad080dac2'],
                      ['torch.float32', [1, 6], 'e7ea4f54a88b8809'],
                      ['torch.float32', [4, 6], '45a99655901702d5'],
                      ['torch.float32', [2, 6], 'b38a7cbad080dac2'],
                      None,
                      None,
                      None,
                      None],
               'pd': [None, None, ['torch.float32', [4, 6], '45a99655901702d5'], None],
               'pm': [['torch.float32', [4, 6], '45a99655901702d5'], None],
               'pw': [None,
                      ['torch.float32', [4, 6], '45a99655901702d5'],
                      ['torch.float32', [4, 3], 'bd1189ecbfc4fc07'],
                      None,
                      None],
               'pn': [['torch.float32', [4, 6], '45a99655901702d5'],
                      ['torch.float32', [4, 6], '45a99655901702d5'],
                      None],
               'b1': [None, None],
               'nope': [None, None]},
 'par_read_bad_target': [None],
 'par_batch_get': [[['torch.float32', [4, 6], '45a99655901702d5'], None, None],
                   [['torch.float32', [4, 6], '45a99655901702d5'],
                    ['torch.float32', [4, 6], '45a99655901702d5'],
                    None],
                   [None, None, None]],
 'par_into': [['torch.float32', [1, 6], 'e7ea4f54a88b8809'],
              304,
              False,
              ['torch.float32', [4, 6], '45a99655901702d5'],
              True,
              True,
              None,
              None],
 'par_batch_into': [['torch.float32', [4, 6], '45a99655901702d5'],
                    ['torch.float32', [4, 6], '45a99655901702d5']],
 'par_from': [0,
              ['_tp_0', '_tp_1'],
              [352, '92d1b867a8fd2939'],
              0,
              True,
              0,
              [352, '92d1b867a8fd2939'],
              0,
              [400, '15a13fec708dd637'],
              -600],
 'par_upsert': [0,
                ['torch.float32', [2, 6], 'b38a7cbad080dac2'],
                0,
                ['torch.float32', [4, 6], 'b2ad35953fd226d7'],
                0,
                [400, '2839c29aca88a4fb']],
 'par_batch_put': [[0, 0],
                   [0, 0],
                   [-600, -600],
                   [0, 0],
                   [0, -600],
                   [-600],
                   [-600],
                   [-600, -600],
                   [0],
                   [0, -600],
                   [0],
                   [1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1]],
 'par_call_key_int': 'TypeError',
 'par_call_config_str': 'TypeError',
 'par_call_not_tensor': 'AttributeError',
 'unreg': 0}
# fmt: on


def _diff(got: dict[str, Any]) -> dict[str, Any]:
    return {k: (got.get(k), v) for k, v in EXPECTED.items() if got.get(k) != v}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensor_family_ours(tmp_path: Path) -> None:
    script = parity._script(tmp_path, TENSORS)
    with harness.our_master() as (master, metadata):
        got = parity._call(sys.executable, script, True, master, metadata)
    assert _diff(got) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensor_family_published(tmp_path: Path) -> None:
    real = parity.published_python_with("torch", "safetensors")
    script = parity._script(tmp_path, TENSORS)
    with harness.their_master(real) as (master, metadata):
        got = parity._call(real, script, False, master, metadata)
    assert _diff(got) == {}


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    master = MasterServer(rpc_port=0, http_port=-1).start_in_thread()
    s = MooncakeDistributedStore()
    try:
        assert (
            s.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.address) == 0
        )
        yield s
    finally:
        s.close()
        master.shutdown()


@pytest.mark.timeout(90)
def test_format_round_trips_and_reads_our_own_typed_values(
    store: MooncakeDistributedStore,
) -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    packed = tensor_format.pack(t)
    assert len(packed) == tensor_format.HEADER_SIZE + 24 and packed[:4] == b"NOOM"
    assert torch.equal(tensor_format.unpack(packed), t)
    shard = tensor_format.pack(t[:, 2:], tensor_format.Shard(1, 2, 1, (3, 4)))
    head = tensor_format.unpack_header(shard)
    assert head.shape == (3, 2) and head.shard == tensor_format.Shard(1, 2, 1, (3, 4))
    with pytest.raises(tensor_format.TensorFormatError):
        tensor_format.unpack(packed[:-1])  # data shorter than the header says
    with pytest.raises(tensor_format.TensorFormatError):
        tensor_format.unpack_header(b"MOON" + packed[4:])
    # bytes put as bytes read back as a tensor: the object format is the interface
    assert store.put("as_bytes", packed) == 0
    assert torch.equal(store.get_tensor("as_bytes"), t)
    # tensors our own StoreClient.put_tensor wrote (mooncake_core.store.values) read too
    client = store.get_client()
    assert client is not None
    client.put_tensor("native", t)
    assert torch.equal(store.get_tensor("native"), t)
    assert torch.equal(store.batch_get_tensor(["native"])[0], t)


@pytest.mark.timeout(90)
def test_get_tensor_into_shares_registered_memory(store: MooncakeDistributedStore) -> None:
    t = torch.linspace(0, 1, 1000, dtype=torch.float64).reshape(10, 100)
    assert store.put_tensor("t", t) == 0
    n = 1 << 16
    buf = (ctypes.c_char * n)()
    p = ctypes.addressof(buf)
    assert store.register_buffer(p, n) == 0
    got = store.get_tensor_into("t", p, n)
    assert torch.equal(got, t)
    got[0, 0] = 42.0  # shares the registered memory
    assert store.put_tensor_from("t2", p, store.get_size("t")) == 0
    assert store.get_tensor("t2")[0, 0].item() == 42.0
    assert store.unregister_buffer(p) == 0
