"""``mxconv inspect``: what a checkpoint is, from headers and the manifest alone (no weights read)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from mxconv.cli.common import SOURCE_HELP, Command, DebugOpt, JsonOpt, RevisionOpt, app, errors, human_bytes, print_json
from mxconv.cli.flags import in_cli_words
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
    quiet: Annotated[bool, typer.Option("--quiet", help="One line: path, family, kind, layers, experts, expert format.")] = False,
    debug: DebugOpt = False,
) -> None:
    """What a checkpoint is: family, sizes, formats, bytes, and per-backend padded sizes/overhead.

    Reads headers and the manifest only (no weights). A tensor-parallel output (repack --tp N) shows
    every rank's directory, shard files and bytes; OUTPUT/rank-N shows that rank. Example:

    \b
        mxconv inspect openai/gpt-oss-20b
    """
    with errors(debug):
        doc = _document(path, revision, engine, gpu)
        if as_json:
            print_json(doc)
            return
        if quiet:
            out.print(_one_line(doc), soft_wrap=True)
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
            _print_with_notes(*_backend_table(doc))
        if doc.get("engine"):
            for table, notes in _engine_tables(doc["engine"]):
                _print_with_notes(table, notes)
            if doc["engine"].get("note"):
                out.print(doc["engine"]["note"])


def _one_line(doc: dict) -> str:
    """``inspect --quiet``: "PATH: family, kind (backend, activation), N MoE layers, E experts, format experts"."""
    model, m = doc.get("model") or {}, doc.get("manifest") or {}
    kind = (f"mxconv {doc['kind']} output" if m else "checkpoint") + (
        f" ({m.get('backend')}, {m.get('activation')})" if doc["kind"] == "kernel" else "")
    parts = [str(doc.get("family") or "unknown family"), kind]
    layers = doc.get("moe_layers") or model.get("num_layers")
    parts += [f"{layers} MoE layers" if "moe_layers" in doc else f"{layers} layers"] if layers else []
    parts += [f"{model['num_experts']} experts"] if model.get("num_experts") else []
    parts += [f"{model['expert_format']} experts"] if model.get("expert_format") else []
    return f"{doc['path']}: " + ", ".join(parts)


class _Notes:
    """Text too long for a table cell, numbered under the table; a cell holds "[n]". Commands go on
    lines of their own, never wrapped (copy-pasteable at any width)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, list[str]]] = []
        self.after: list[str] = []

    def ref(self, text: str, commands: list[str] | None = None, unnumbered: bool = False) -> str:
        if unnumbered:
            self.after.append(text)
            return ""
        self.items.append((text, commands or []))
        return f"[{len(self.items)}]"


def _print_with_notes(table: Table, notes: _Notes) -> None:
    out.print(table)
    for i, (text, commands) in enumerate(notes.items, 1):
        if text:
            out.print(f"[{i}] {in_cli_words(text)}")
        for c in commands:
            out.print(("    " if text else f"[{i}] ") + c, soft_wrap=True)
    for text in notes.after:
        out.print(in_cli_words(text))


def _served_cell(methods: dict[str, list[str]], tags_used: set[str]) -> str:
    """The vLLM backends holding a layout's bytes, one per line, each with the methods it is held under
    when that is not quant_method mxfp4 alone (the legend under the table names them)."""
    from mxconv.layouts.vllm_serving import VllmMethod

    by_backend: dict[str, list[str]] = {}
    for m, names in methods.items():
        for b in names:
            by_backend.setdefault(b, []).append(VllmMethod(m).tag)
    lines = []
    for b, tags in by_backend.items():
        marked = tags != [VllmMethod.MXFP4.tag]
        tags_used.update(tags if marked else ())
        lines.append(b + (f" ({', '.join(tags)})" if marked else ""))
    return "\n".join(lines) or "-"


def _backend_table(doc: dict) -> tuple[Table, _Notes]:
    """Per backend/activation: padding, bytes and the vLLM backends holding the bytes; refusals numbered
    under the table, and the vLLM quantization methods named there. Narrow enough for 100 columns."""
    from mxconv.layouts.vllm_serving import VllmMethod

    src_fmt = (doc.get("model") or {}).get("expert_format")
    fmt = str(src_fmt).upper() if src_fmt in ("int4", "mxfp8") else "MXFP4"
    b, notes, tags = Table(title=f"per-backend kernel layout ({fmt} experts)"), _Notes(), set()
    for col in ("backend, activation", "padded H, I", "bytes", "overhead", "vLLM 0.33 backends"):
        b.add_column(col, no_wrap=True)
    for row in doc["backends"]:
        name = f"{row['backend']} {row['activation']}"
        if row.get("weight_format", fmt.lower()) != fmt.lower():  # a layout that takes no MXFP4: what repack makes
            name += f" ({row['weight_format']})"
        if "error" in row:
            b.add_row(name, "-", "-", "no " + notes.ref("refused: " + row["error"]), "-")
        else:
            b.add_row(name, f"{row['padded_hidden_size']}, {row['padded_intermediate_size']}", human_bytes(row["expert_bytes"]),
                      f"{100 * row['padding_overhead']:+.1f}%", _served_cell(row["vllm_methods"], tags))
    legend = "; ".join(f"{m.tag}: {m.label}" for m in VllmMethod if m.tag in tags)
    notes.ref(f"vLLM 0.33 backends: those holding these bytes under {VllmMethod.MXFP4.label}"
              + (f", or as marked ({legend})" if legend else ""), unnumbered=True)
    return b, notes


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


def _holder_cell(h: dict, notes: _Notes) -> str:
    """One mxconv output in the engine table: short name, padding, yes/no; the reason and the command
    that writes it numbered under the table."""
    from mxconv.layouts.vllm_serving import VllmMethod

    name = h.get("layout") or f"{h['backend']} {h['activation']}" + "".join(f" {k}={v}" for k, v in (h.get("options") or {}).items())
    pads = f" ({h['padded'][0]}, {h['padded'][1]})" if h.get("padded") else ""
    if h.get("refusal") is None:
        return f"{name}{pads}: yes " + notes.ref("", [h["command"]] if h.get("command") else [])
    why = f"{h['output']}: not as is: {h['refusal']}"
    elsewhere = "; ".join(f"{', '.join(bs)} under {VllmMethod(m).label}" for m, bs in (h.get("served_elsewhere") or {}).items())
    return f"{name}{pads}: no " + notes.ref(why + (f". It is held by {elsewhere}" if elsewhere else ""))


def _this_output(row: dict) -> str:
    """Why the inspected output is not what ``row``'s engine picks, and what holds it instead."""
    from mxconv.layouts.vllm_serving import VllmMethod

    held = "; ".join(f"{', '.join(bs)} under {VllmMethod(m).label}" for m, bs in row.get("this_output_served", {}).items())
    return f"this output does not hold {row['backend']}'s bytes under {VllmMethod(row['method']).label}" + (
        f"; it holds those of {held}" if held else "; no vLLM backend holds it as is")


def _engine_tables(report: dict) -> list[tuple[Table, _Notes]]:
    """``inspect --engine``: one table per GPU: each form of the checkpoint, the engine's pick, the padding
    it allocates (H, I per rank), the mxconv outputs holding those bytes (why one does not, and the
    command writing one that does, numbered under the table)."""
    tables = []
    for g in report["gpus"]:
        t, notes = Table(title=f"{report['engine']} on {g['gpu']}: default MoE backend"), _Notes()
        for col in ("form (engine sees)", "picks", "pads H, I", "mxconv output holding it"):
            t.add_column(col, no_wrap=col in ("picks", "pads H, I"))
        for r in g["rows"]:
            held = []
            if "this_output_holds_it" in r:
                held.append("this output: " + ("yes" if r["this_output_holds_it"] else "no " + notes.ref(_this_output(r))))
            held += [_holder_cell(h, notes) for h in r.get("held_by", [])]
            held += [notes.ref(n) for n in (r.get("note"), None if r.get("backend") else r.get("why")) if n]
            pad = r.get("engine_padding")
            t.add_row(r["form"] + (f" ({r['kind']})" if r.get("kind") else ""), str(r.get("backend") or "none"),
                      f"{pad[0]}, {pad[1]}" if pad else "-", "\n".join(held) or "-")
        tables.append((t, notes))
    return tables
