"""The figures page and the README's figures summary, both from ``bench/results.json`` (what ``make bench``
writes): no number is copied by hand, so a new bench run is one ``make docs`` away from every page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from docsgen.reference import GENERATED, ROOT, DocsError

RESULTS = ROOT / "bench" / "results.json"
GPU_RESULTS = ROOT / "bench" / "gpu_check.json"

# The README's summary: (figure name in results.json, what it says to a newcomer). A name that no longer
# exists in the results fails the generator.
SUMMARY = (
    ("job steady / (cores x per-core floor)", "the job's speed against decoding alone on the same cores"),
    ("job / naive path (stock Pillow), per core", "the job against a plain Pillow decode + resize"),
    ("job / img2dataset-style (OpenCV INTER_AREA)", "the job against an img2dataset-style resize"),
    ("reader sequential / WebDataset+PIL loader", "the reader against a WebDataset + PIL DataLoader"),
    ("reader sequential / np.copyto", "the reader against copying the same bytes in memory"),
    ("shardio / LitData, warm epoch from S3", "reading from S3 through the cache against LitData"),
    ("shardio / Mosaic Streaming, warm epoch from S3", "the same against Mosaic Streaming"),
)


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _value(figure: dict[str, Any]) -> str:
    value, unit = figure["value"], (figure.get("unit") or "x")
    if value is None:
        return "n/a"
    text = f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{text}{unit}" if unit.startswith(" ") else f"{text}{unit}"


def _target(figure: dict[str, Any]) -> str:
    if figure.get("target") is None:
        return ""
    unit = figure.get("unit") or "x"
    op = {">=": "≥", "<=": "≤"}.get(figure.get("op", ">="), figure.get("op", ""))
    return f"{op} {figure['target']}{unit}"


def _met(figure: dict[str, Any]) -> str:
    return {True: "yes", False: "no", None: ""}[figure.get("met")]


def _table(figures: list[dict[str, Any]]) -> str:
    rows = ["| figure | measured | target | met | detail |", "|---|---|---|---|---|"]
    for f in figures:
        detail = (f.get("detail") or "").replace("|", "\\|")
        rows.append(f"| {f['name']} | {_value(f)} | {_target(f)} | {_met(f)} | {detail} |")
    return "\n".join(rows)


def _machine(results: dict[str, Any]) -> str:
    m = results["machine"]
    corpus = results["corpus"]
    config = results["config"]
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; corpus: {corpus['images']:,} LAION-like JPEGs "
            f"({corpus['megapixels_mean']} MP mean, quality {corpus['quality_range'][0]}-{corpus['quality_range'][1]}) "
            f"in {len(corpus['tars'])} tars; target {config['height']}×{config['width']} {config['mode']}")


def figures_page(results: dict[str, Any] | None = None) -> str:
    from shardio.read.order import DEFAULT_SHUFFLE_BLOCK, DEFAULT_SHUFFLE_WINDOW

    results = results or load_results()
    reader = results.get("reader", {})
    setting = reader.get("shuffled_setting")
    default = f"shuffle w={DEFAULT_SHUFFLE_WINDOW} b={DEFAULT_SHUFFLE_BLOCK}"
    shuffle_note = ""
    if setting and setting != default:
        shuffle_note = (f"\nThe shuffled-reader row was measured with `{setting}` (windows of shards, blocks of "
                        f"samples), not the default order (`{default}`); `python -m bench.reader "
                        "--shuffled-gather` (run by `make bench`) measures the default beside it.\n")
    store = results.get("object_store")
    store_part = ""
    if store:
        store_part = f"""
## Object storage

`python -m bench.object_store` (run by `make bench`): a SeaweedFS server on loopback sharing the machine's
cores with the client; LitData and Mosaic Streaming run in their own environment. Run of {store.get('date', 'n/a')}.

{_table(store['figures'])}
"""
    cold = results.get("cold_epoch")
    if cold:
        store_part += f"""
## Every epoch cold

`python -m bench.cold_epoch` (run by `make bench`): the reader streaming from the S3, GCS and Azure emulators
on loopback with a cache of a third of the dataset (every epoch downloads every shard; timed after one untimed
epoch, as the local reader is), against the slower of raw parallel GETs of the same objects and the local-disk
reader, raw and JPEG shards. The emulators share the machine's cores with the reader, so each row also gives the
whole machine's CPU seconds per GB each way and what their ratio allows: where the server and the reader share two
cores, the cold epoch cannot pass it. Run of {cold.get('date', 'n/a')}.

{_table(cold['figures'])}
"""
    return f"""{GENERATED}
# Figures

Every figure is a ratio of two rates measured in the same run on the same images: absolute rates on a
shared machine drift between runs, ratios much less. `make bench` measures them and writes
`bench/results.json`, `bench/results.md` and `bench/chart.png`; this page is generated from
`bench/results.json` (`bench/README.md` says what each module measures).

Machine and corpus: {_machine(results)}.

## Preprocessing and reading

{_table(results['figures'])}
{shuffle_note}{store_part}
{gpu_section()}
## Measuring on your machine

- `preprocess diagnose 'data/*.tar' --limit 500`: where the job's time goes on your images, per stage, and a
  projection for a million images ([Troubleshooting](../guides/troubleshooting.md)).
- `shardio bench DIR --target-rate 3000`: would a GPU consuming 3,000 samples/s wait for data?
- `make gpu-check` on a GPU machine: the GPU decode path (`bench/gpu_check.md` holds the last run).
- The index and the epoch plan at 300 to 2.3M shards: `python -m bench.scale` and `python -m bench.scale_plan`
  (both run by `make bench`; they print their tables rather than adding to `bench/results.json`).
"""


def readme_summary(results: dict[str, Any] | None = None) -> str:
    """The README's short figures table (between its ``figures`` markers)."""
    results = results or load_results()
    by_name = {f["name"]: f for f in results["figures"]}
    by_name.update({f["name"]: f for f in (results.get("object_store") or {}).get("figures", [])})
    rows = ["| what | measured |", "|---|---|"]
    for name, words in SUMMARY:
        if name not in by_name:
            raise DocsError(f"docsgen/figures.py SUMMARY names {name!r}, which bench/results.json lacks")
        rows.append(f"| {words} | {_value(by_name[name])} |")
    m = results["machine"]
    return (f"On {m['cores']} cores of a shared {m['cpu']} (`make bench`; ratios of two rates in one run):\n\n"
            + "\n".join(rows) + "\n")


def gpu_section(path: Path = GPU_RESULTS) -> str:
    """The GPU path from ``bench/gpu_check.json`` (``make gpu-check`` on a GPU machine), if there is a run."""
    if not path.exists():
        return ""
    g = json.loads(path.read_text(encoding="utf-8"))
    env = g.get("env", {})
    rows = ["| figure | measured |", "|---|---|"]
    counts = g.get("cuda_tests", {}).get("counts", {})
    if counts:
        rows.append(f"| CUDA tests (`pytest -m cuda`) | {counts.get('passed', 0)} passed, "
                    f"{counts.get('failed', 0)} failed |")
    for row in g.get("stream_safety", {}).get("rows", []):
        rows.append(f"| stream safety, {row['decoder']}, JPEG {row['jpeg']} | {row['corrupted']} of {row['trials']} "
                    "trials corrupted |")
    for library in ("torchcodec", "torchvision"):
        decoded = g.get("decode", {}).get(library, {}).get("device_decoder")
        if decoded:
            rows.append(f"| batched {g['datasets']['side']}² decode through `DeviceDecoder`, {library} | "
                        f"{decoded['samples_per_s']:,.0f} samples/s |")
    h2d = g.get("h2d", {})
    if h2d:
        rows.append(f"| host to device: the loader's pinned batches / a pinned copy | {h2d['copy_stage_ratio']:.2f} |")
        rows.append(f"| host to device end to end, `DeviceLoader` raw batches / a pinned copy | {h2d['ratio']:.2f} |")
    for label, size in g.get("decode", {}).get("ceiling", {}).get("sizes", {}).items():
        ceilings = [f"{row['best_samples_per_s']:,.0f} samples/s ({name}, {row['best_threads']} host threads)"
                    for name, row in size.items() if isinstance(row, dict) and "best_samples_per_s" in row]
        if ceilings:
            rows.append(f"| the JPEG decoder's ceiling at {label}, batched over host bytes | {'; '.join(ceilings)} |")
        if "device_loader_over_ceiling" in size:
            rows.append(f"| `DeviceLoader` over the JPEG dataset at {label} / the decoder's ceiling | "
                        f"{size['device_loader_over_ceiling']:.2f} |")
    yuv = g.get("yuv420", {})
    if "normalised" in yuv:
        rows.append("| `DeviceLoader` samples/s, yuv420 / raw (normalised batches) | "
                    f"{yuv['normalised']['ratio']:.2f} |")
    if yuv.get("quality", {}).get("psnr_db"):
        rows.append(f"| yuv420 against raw on the photos, median PSNR | {yuv['quality']['psnr_db']['median']} dB |")
    step = g.get("train_step", {})
    for name in ("raw", "jpeg", "yuv420"):
        if name in step:
            rows.append(f"| ResNet-50 step ({step['batch']} at {step['size']}²), share of step time waiting for "
                        f"data, {name} | {step[name]['wait_share']:.1%} |")
    lightning = g.get("lightning_wait", {})
    for name in ("raw", "jpeg", "yuv420"):
        if name in lightning:
            rows.append(f"| Lightning `Trainer`, ResNet-50 ({lightning['batch']} at {lightning['size']}²), share of "
                        f"step time waiting for data, {name} | {lightning[name]['data_wait_share']:.2%} |")
    machine = f"{env.get('card', 'n/a')} with {env.get('cpu_count', 'n/a')} cores, torch {env.get('torch', 'n/a')}"
    return f"""
## The GPU path

`make gpu-check` on a GPU machine (`bench/gpu_check.py`; full tables in `bench/gpu_check.md`). Run of
{env.get('date', 'n/a')} on {machine}:

""" + "\n".join(rows) + "\n"
