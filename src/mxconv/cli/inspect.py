"""``mxconv inspect``: what a checkpoint is, from headers and the manifest alone (no weights read)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from mxconv.cli.common import SOURCE_HELP, Command, DebugOpt, JsonOpt, RevisionOpt, app, errors, human_bytes, print_json
from mxconv.cli.output import out

EngineOpt = Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE", help=(
    "vllm-0.33 | sglang-0.5.23: per GPU, the MoE backend the engine picks by default for the checkpoint "
    "as it is and for each output it can become, the mxconv output holding those bytes, the padding."))]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", metavar="GPU", help=(
    "sm90 | sm100 | sm120 | gfx950 | cpu: the device --engine reports on (default: every one; "
    "--gpu alone means --engine vllm-0.33)."))]


@app.command(cls=Command)
def inspect(
    path: Annotated[str, typer.Argument(metavar="PATH", help=SOURCE_HELP)],
    revision: RevisionOpt = None,
    engine: EngineOpt = None,
    gpu: GpuOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """What a checkpoint is: family, sizes, formats, bytes, and per-backend padded sizes/overhead.

    Reads headers and the manifest only (no weights). A tensor-parallel output (repack --tp N) shows
    every rank's directory, shard files and bytes; OUTPUT/rank-N shows that rank. Example:

        mxconv inspect openai/gpt-oss-20b
    """
    with errors(debug):
        doc = _document(path, revision, engine, gpu)
        if as_json:
            print_json(doc)
            return
        t = Table(title=f"mxconv inspect {doc['path']}", show_header=False)
        t.add_column("key", style="bold")
        t.add_column("value")
        model = doc.get("model") or {}
        t.add_row("family", str(doc.get("family_title") or doc.get("family")))
        t.add_row("kind", doc["kind"] + (f" ({doc['manifest']['backend']}, {doc['manifest']['activation']})" if doc["kind"] == "kernel" else ""))
        if "tp_size" in doc:  # a tensor-parallel output, or one rank of it
            t.add_row("tensor parallel", f"rank {doc['rank']} of {doc['tp_size']} (output {doc['output']})" if "rank" in doc
                      else f"tp_size {doc['tp_size']}: " + ", ".join(r["dir"] for r in doc["ranks"]))
        for k in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "padded_hidden_size",
                  "padded_intermediate_size", "expert_format", "source_expert_format", "row_order", "routing", "activation"):
            if k in model:
                t.add_row(k, str(model[k]))
        if "moe_layers" in doc:
            t.add_row("moe_layers", str(doc["moe_layers"]))
        t.add_row("dtypes", ", ".join(f"{k} x{v}" for k, v in doc["dtypes"].items()))
        t.add_row("tensors / shards", f"{doc['tensors']} / {doc['shards']}")
        t.add_row("bytes: experts", human_bytes(doc["bytes"]["experts"]))
        t.add_row("bytes: rest", human_bytes(doc["bytes"]["rest"]))
        if doc.get("linears"):
            lin = doc["linears"]
            rule = f"scale rounding {lin['scale_rounding']}" if lin.get("scale_rounding") else "amax/448 per 128x128 block"
            t.add_row(f"{lin['format']} linears", f"{len(lin['quantized']) + len(lin.get('carried_mx', []))} ({rule})")
            by_reason: dict[str, list[str]] = {}
            for module, why in lin.get("left_alone", {}).items():
                by_reason.setdefault(why, []).append(module)
            for why, modules in by_reason.items():  # every name in --json; here a few per reason
                shown = ", ".join(modules[:3]) + (f", ... ({len(modules)} in all)" if len(modules) > 3 else "")
                t.add_row("  left alone", f"{why}: {shown}")
        if doc.get("memory"):
            mem = doc["memory"]
            t.add_row("memory (quantize, CPU)", f"{mem['plan']}; smallest --max-memory ~{human_bytes(mem['smallest_max_memory'])}")
        out.print(t)
        if doc.get("ranks"):
            out.print(_ranks_table(doc["ranks"]))
        roles = doc.get("bytes_by_role")
        if roles and (roles.get("before") or roles.get("after")):
            out.print(_roles_table(roles))
        if doc.get("quant_config"):
            from mxconv.output.engine_quant_config import EngineQuantConfig

            q = Table(title="engine quant config (fused MoE, per layer L)", show_header=False)
            for key, value in EngineQuantConfig.from_json(doc["quant_config"]).summary_rows():
                q.add_row(key, value)
            out.print(q)
        if doc.get("backends"):
            src_fmt = (doc.get("model") or {}).get("expert_format")
            fmt = str(src_fmt).upper() if src_fmt in ("int4", "mxfp8") else "MXFP4"
            b = Table(title=f"per-backend kernel layout ({fmt} experts)")
            for col in ("backend", "activation", "padded H", "padded I", "expert bytes", "padding overhead", "vLLM 0.33 backends"):
                b.add_column(col)
            for row in doc["backends"]:
                if "error" in row:
                    b.add_row(row["backend"], row["activation"], "-", "-", "-", row["error"], "-")
                else:
                    b.add_row(row["backend"], row["activation"], str(row["padded_hidden_size"]), str(row["padded_intermediate_size"]),
                              human_bytes(row["expert_bytes"]), f"{100 * row['padding_overhead']:+.1f}%", ", ".join(row["vllm_backends"]) or "-")
            out.print(b)
        for table in _engine_tables(doc["engine"]) if doc.get("engine") else ():
            out.print(table)


def _ranks_table(ranks: list[dict]) -> Table:
    """Per rank of a TP output: directory, intermediate slice, padded sizes, shard files and bytes on disk."""
    t = Table(title="tensor-parallel ranks")
    for col in ("rank", "directory", "intermediate", "padded H", "padded I", "shard files", "bytes"):
        t.add_column(col)
    for r in ranks:
        span = r["intermediate_range"]
        t.add_row(str(r["rank"]), r["dir"] + "/", f"[{span[0]}, {span[1]}) = {r['intermediate_size']}" if span else "-",
                  str(r["padded_hidden_size"]), str(r["padded_intermediate_size"]),
                  "\n".join(f"{s['file']} ({human_bytes(s['bytes'])})" for s in r["shards"]), human_bytes(r["bytes"]))
    return t


def _roles_table(roles: dict) -> Table:
    """Bytes per tensor role before and after the conversion (``inspect``'s bytes_by_role)."""
    before, after = roles.get("before") or {}, roles.get("after") or {}
    r = Table(title="bytes by role" + (f" (after: {roles['after_error']})" if roles.get("after_error") else ""))
    for col in ("role", f"before ({roles['before_label']})", f"after ({roles['after_label']})"):
        r.add_column(col)
    for role in [*before, *(k for k in after if k not in before)]:
        r.add_row(role, human_bytes(before.get(role)) if roles.get("before") else "-",
                  human_bytes(after.get(role)) if roles.get("after") else "-")
    r.add_row("total", human_bytes(sum(before.values())) if before else "-", human_bytes(sum(after.values())) if after else "-")
    return r


def _document(path: str, revision: str | None, engine: str | None, gpu: str | None) -> dict:
    """inspect's document; with --engine or --gpu, :func:`mxconv.inspect.inspect_engine`'s."""
    from mxconv.inspect import inspect_engine, inspect_path

    if engine is None and gpu is None:
        return inspect_path(path, revision)
    return inspect_engine(path, engine or "vllm-0.33", (gpu,) if gpu else None, revision)


def _engine_tables(report: dict) -> list[Table]:
    """``inspect --engine``: one table per GPU: each form of the checkpoint, the engine's pick, the padding
    it allocates (H, I per rank), the mxconv outputs holding those bytes (and why one does not)."""
    tables = []
    for g in report["gpus"]:
        t = Table(title=f"{report['engine']} on {g['gpu']}: default MoE backend")
        for col in ("form", "engine sees", "picks", "engine pads (H, I)", "mxconv output holding it"):
            t.add_column(col)
        for r in g["rows"]:
            held = [h["output"] + (f" (pads to {tuple(h['padded'])})" if h.get("padded") else "")
                    + (f": not as is, {h['refusal']}" if h.get("refusal") else "") for h in r.get("held_by", [])]
            if "this_output_holds_it" in r:
                held.insert(0, "this output: " + ("yes" if r["this_output_holds_it"] else "no, it holds other bytes"))
            notes = [n for n in (r.get("note"), None if r.get("backend") else r.get("why")) if n]
            pad = r.get("engine_padding")
            t.add_row(r["form"], str(r.get("kind") or "-"), str(r.get("backend") or "none"),
                      str(tuple(pad)) if pad else "-", "\n".join(held + notes) or "-")
        tables.append(t)
    return tables
