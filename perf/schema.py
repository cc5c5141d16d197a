"""The JSON a perf run writes, checked: a run is {schema, kind, command, date, env, method,
roofline, config, results, ...}; a collection (perf/results/h100.json) is {schema, runs}.

``validate_run`` / ``validate_collection`` raise ValueError naming the first problem, so a
hand-edited or truncated results file fails loudly instead of rendering wrong tables.
"""

from __future__ import annotations

RUN_SCHEMA = "kbit_cute.perf/1"
COLLECTION_SCHEMA = "kbit_cute.perf.collection/1"
STATUSES = {"ok", "failed", "unavailable", "skipped"}

_RUN_KEYS = {"schema", "kind", "command", "date", "env", "method", "roofline", "config", "results"}
_GEMM_RECORD = {
    "shape": str, "M": int, "impl": str, "status": str, "graph_us": (float, int, type(None)),
    "eager_us": (float, int, type(None)), "bytes": (int, type(None)),
    "speedup": (float, int, type(None)), "pct_roofline": (float, int, type(None)),
}  # fmt: skip
_DECODE_RECORD = {
    "model": str, "batch": int, "variant": str, "status": str,
    "step_us": (float, int, type(None)), "tokens_per_s": (float, int, type(None)),
    "speedup": (float, int, type(None)), "linear_frac": (float, int, type(None)),
}  # fmt: skip
_MOE_RECORD = {
    "model": str, "T": int, "impl": str, "status": str, "graph_us": (float, int, type(None)),
    "eager_us": (float, int, type(None)), "touched_bytes": (float, int, type(None)),
}  # fmt: skip
_CONFIG_KEYS = {"gemm": {"dtype", "ks", "ms", "models", "impls", "shapes"},
                "decode": {"models", "batches", "ks", "dtype"},
                "moe": {"models", "ts", "ks", "dtype", "impls", "specs"}}  # fmt: skip
_RECORDS = {"gemm": _GEMM_RECORD, "decode": _DECODE_RECORD, "moe": _MOE_RECORD}


def validate_run(run: dict) -> dict:
    if not isinstance(run, dict):
        raise ValueError(f"a run must be a JSON object, got {type(run).__name__}")
    missing = _RUN_KEYS - run.keys()
    if missing:
        raise ValueError(f"run is missing keys {sorted(missing)}")
    if run["schema"] != RUN_SCHEMA:
        raise ValueError(f"run schema {run['schema']!r}, expected {RUN_SCHEMA!r}")
    kind = run["kind"]
    if kind not in _CONFIG_KEYS:
        raise ValueError(f"run kind {kind!r}, expected one of {sorted(_CONFIG_KEYS)}")
    missing = _CONFIG_KEYS[kind] - run["config"].keys()
    if missing:
        raise ValueError(f"{kind} run config is missing {sorted(missing)}")
    fields = _RECORDS[kind]
    if not isinstance(run["results"], list):
        raise ValueError("run results must be a list")
    for i, rec in enumerate(run["results"]):
        for key, typ in fields.items():
            if key not in rec:
                raise ValueError(f"{kind} result {i} has no {key!r}")
            if not isinstance(rec[key], typ) or isinstance(rec[key], bool):
                raise ValueError(f"{kind} result {i}: {key} = {rec[key]!r} has the wrong type")
        if rec["status"] not in STATUSES:
            raise ValueError(
                f"{kind} result {i}: status {rec['status']!r} not in {sorted(STATUSES)}"
            )
        if rec["status"] == "ok" and (rec.get("graph_us") or rec.get("step_us")) is None:
            raise ValueError(f"{kind} result {i} is ok but has no time")
    if kind == "gemm":
        shapes = {s["shape"] for s in run["config"]["shapes"]}
        keys = {i["key"] for i in run["config"]["impls"]}
        for i, rec in enumerate(run["results"]):
            key = rec["impl"] if rec.get("k") is None else f"{rec['impl']}{rec['k']}"
            if rec["shape"] not in shapes or key not in keys:
                raise ValueError(f"gemm result {i} ({rec['shape']}, {key}) is not in the config")
    return run


def validate_collection(coll: dict) -> dict:
    if not isinstance(coll, dict) or coll.get("schema") != COLLECTION_SCHEMA:
        raise ValueError(f"a results collection needs schema {COLLECTION_SCHEMA!r}")
    if not isinstance(coll.get("runs"), list) or not coll["runs"]:
        raise ValueError("a results collection needs a non-empty 'runs' list")
    for run in coll["runs"]:
        validate_run(run)
    return coll


def as_collection(obj: dict) -> dict:
    """A collection, or a single run wrapped as one."""
    if isinstance(obj, dict) and "runs" in obj:
        return validate_collection(obj)
    return validate_collection({"schema": COLLECTION_SCHEMA, "runs": [validate_run(obj)]})
