"""``make bench``'s main table (``bench.run``): each measured value as a figure row against its target, and the
rows, the per-core decode paths and the machine as ``results.md``."""

from __future__ import annotations

from typing import Any

from bench.buckets import AREA_RANGE, TARGET_MEDIAN, TARGET_P95, TARGET_RATE
from bench.buckets import summary_lines as bucket_lines
from bench.job_jpeg import TARGET as JPEG_JOB_TARGET
from bench.job_jpeg import summary_line

def _figure(
    name: str,
    value: float | None,
    target: float | None = None,
    op: str = ">=",
    unit: str = "x",
    detail: str = "",
) -> dict[str, Any]:
    met = None
    if value is not None and target is not None:
        met = value >= target if op == ">=" else value <= target
    return {
        "name": name,
        "value": None if value is None else round(value, 3),
        "target": target,
        "op": op,
        "unit": unit,
        "met": met,
        "detail": detail,
    }


def figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    cores = r["machine"]["cores"]
    paths, job, reader, memory = r["paths"], r["job"], r["reader"], r["memory"]
    steady = job["all_cores"]["marginal_images_per_s"]
    one = job["one_cpu"]["marginal_images_per_s"]
    floor = paths["floor"]["images_per_s"]
    simd = paths["naive_simd"]
    stock = paths.get("naive_stock")
    stock_pil = r.get("stock_pillow", {})
    out = [
        _figure(
            "job steady / (cores x per-core floor)",
            job["all_cores"]["ratio_median"],
            0.9,
            detail=f"median of {len(job['all_cores']['rounds'])} interleaved rounds, spread "
            f"{job['all_cores']['ratio_min']:.3f}-{job['all_cores']['ratio_max']:.3f}; "
            f"{steady:.0f} vs {job['all_cores']['floor_images_per_s']:.0f} img/s "
            f"(draft+load, {cores} processes)",
        ),
        _figure(
            "job / naive path (stock Pillow), per core",
            steady / stock["images_per_s"] if stock else None,
            2.5,
            detail=f"naive {stock['ms_per_image_per_core']:.2f} ms/img/core, Pillow {stock_pil['pil_version']} "
            f"(libjpeg-turbo {stock_pil['libjpeg_turbo']})"
            if stock
            else f"skipped: {stock_pil.get('skipped', 'not measured')}",
        ),
        _figure(
            "job / naive path (Pillow-SIMD), per core",
            steady / simd["images_per_s"],
            detail=f"naive {simd['ms_per_image_per_core']:.2f} ms/img/core"
            + (
                f"; stock / SIMD naive time {simd['images_per_s'] / stock['images_per_s']:.2f}x"
                if stock
                else ""
            ),
        ),
    ]
    if stock:
        floor_stock = paths["floor_stock"]
        out.append(
            _figure(
                "floor, stock Pillow / floor, this PIL (libjpeg-turbo)",
                floor_stock["images_per_s"] / floor,
                detail=f"{floor_stock['ms_per_image_per_core']:.2f} vs "
                f"{paths['floor']['ms_per_image_per_core']:.2f} ms/img/core; libjpeg-turbo "
                f"{stock_pil['libjpeg_turbo']} vs {r['pillow_build']['libjpeg_turbo']}",
            )
        )
    if "floor_libjpeg" in paths:
        strict = paths["floor_libjpeg"]
        out.append(
            _figure(
                "job steady / (cores x libjpeg floor: the job's decoder, whole image)",
                job["all_cores"]["ratio_median"] * floor / strict["images_per_s"],
                detail=f"the headline x floor / libjpeg floor ({paths['floor']['ms_per_image_per_core']:.2f} vs "
                f"{strict['ms_per_image_per_core']:.2f} ms/img/core: Pillow's own share of its draft + load)",
            )
        )
    if "img2dataset" in paths:
        out.append(
            _figure(
                "job / img2dataset-style (OpenCV INTER_AREA)",
                steady / paths["img2dataset"]["images_per_s"],
                2.0,
                detail=f"{paths['img2dataset']['ms_per_image_per_core']:.2f} ms/img/core",
            )
        )
    else:
        out.append(
            _figure("job / img2dataset-style (OpenCV INTER_AREA)", None, 2.0, detail="OpenCV not installed")
        )
    if "jpeg_vs_raw" in job:
        out.append(_figure("job jpeg / job raw (images/s)", job["jpeg_vs_raw"]["ratio_median"], JPEG_JOB_TARGET,
                           detail=summary_line(job["jpeg_vs_raw"])))
    if "buckets" in r:
        out += _bucket_figures(r["buckets"])
    out += [
        _figure(
            "scaling efficiency 1 -> all cores",
            steady / (cores * one),
            0.9,
            detail=f"{one:.0f} img/s on 1 CPU, {steady:.0f} on {cores}",
        ),
        _figure(
            "job fixed start-up cost",
            job["cold"]["fixed_startup_s"],
            unit=" s",
            detail=f"cold run of {job['cold']['images']} images: {job['cold']['seconds']:.1f} s; "
            f"ray.init {job['cold']['ray_startup_s']:.1f} s",
        ),
        _figure(
            "transform alone / floor (no tar, Ray, write)",
            paths["transform"]["images_per_s"] / floor,
            detail=f"{paths['transform']['ms_per_image_per_core']:.2f} vs "
            f"{paths['floor']['ms_per_image_per_core']:.2f} ms/img/core",
        ),
        _figure(
            "worker without Ray / floor (tar read, transform, shard write)",
            paths["worker"]["images_per_s"] / floor,
            detail=f"{paths['worker']['ms_per_image_per_core']:.2f} ms/img/core",
        ),
        _figure("job steady / worker without Ray (what Ray costs)", steady / paths["worker"]["images_per_s"]),
    ]
    cluster = job.get("two_node_cluster")
    if cluster:
        rate = cluster["marginal_images_per_s"]
        out.append(
            _figure(
                "2-node cluster (1 CPU each) / (2 x 1 CPU)",
                rate / (2 * one),
                detail=f"{rate:.0f} img/s; inputs per node {sorted(cluster['inputs_per_node'].values())}",
            )
        )
    out += [
        _figure(
            "worker peak RSS",
            memory["worker_peak_rss_mb"],
            400,
            op="<=",
            unit=" MB",
            detail=f"{memory['size'][0]}x{memory['size'][1]}, {memory['samples_per_shard']}-sample shards",
        ),
        _figure("driver peak RSS", memory["driver_peak_rss_mb"], unit=" MB", detail="preprocess run (CLI)"),
        _figure(
            "reader sequential / np.copyto",
            reader["sequential"]["of copyto"],
            0.7,
            detail=f"{reader['sequential']['GB/s']:.2f} vs {reader['copyto']['GB/s']:.2f} GB/s",
        ),
        _figure(
            "reader shuffled / np.copyto",
            reader["shuffled"]["of copyto"],
            0.5,  # a shuffled read keeps the reader at >= 0.5 x np.copyto
            detail=f"{reader['shuffled_setting']}: {reader['shuffled']['GB/s']:.2f} GB/s",
        ),
    ]
    wds = reader.get("webdataset_pil_samples_per_s")
    out.append(
        _figure(
            "reader sequential / WebDataset+PIL loader",
            reader["sequential"]["samples/s"] / wds if wds else None,
            100,
            detail=f"{reader['sequential']['samples/s']:.0f} vs {wds or 0:.1f} samples/s",
        )
    )
    return out


def _bucket_figures(b: dict[str, Any]) -> list[dict[str, Any]]:
    """mode: bucket's rows (bench.buckets): aspect kept on the corpus at the 256² budget, stored area, job cost."""
    aspect, lines = b["aspect"], bucket_lines(b)
    out = [
        _figure("aspect error median, mode bucket (|log w/h| vs source)", aspect["bucket"]["median"], TARGET_MEDIAN,
                op="<=", unit="", detail=lines[0]),
        _figure("aspect error p95, mode bucket", aspect["bucket"]["p95"], TARGET_P95, op="<=", unit="",
                detail=lines[1]),
        _figure("bucket stored area / budget, min", aspect["area_min"], AREA_RANGE[0], unit="",
                detail=f"range {aspect['area_min']}-{aspect['area_max']} (<= {AREA_RANGE[1]}); buckets (h x w) "
                + " ".join(f"{h}x{w}" for h, w in b["buckets"])),
    ]
    if "job" in b:
        out.append(_figure("job bucket / job center_crop (images/s)", b["job"]["ratio_median"], TARGET_RATE,
                           detail=lines[2]))
    return out


def markdown(r: dict[str, Any]) -> str:
    build, corpus, cores = r["pillow_build"], r["corpus"], r["machine"]["cores"]
    lines = [
        "# Benchmark results",
        "",
        f"{cores} cores ({r['machine']['cpu']}), {r['machine']['memory_gb']} GiB; "
        f"PIL {build['pil_version']} ({'Pillow-SIMD' if build['pillow_simd'] else 'stock Pillow'}, "
        f"AVX2 build: {build['built_with_avx2']}), libjpeg-turbo {build['libjpeg_turbo']}. "
        f"Corpus: {corpus['images']} JPEGs, {corpus['megapixels_mean']} MP mean, "
        f"{corpus['bits_per_pixel']} bits/px, "
        f"quality {corpus['quality_range'][0]}-{corpus['quality_range'][1]}, "
        f"tars of {corpus['spec']['samples_per_tar']}; target 256x256 centre crop."
        + (" **Quick run: too small to quote.**" if r["quick"] else "")
        + f" Other processes used {r['foreign_load']['mean_cores']} cores on average during the run "
        f"(max {r['foreign_load']['max_cores']} over 2 s): near 0 for ratios worth quoting.",
        "",
        "| figure | measured | target | met | detail |",
        "|---|---|---|---|---|",
    ]
    for f in r["figures"]:
        value = "n/a" if f["value"] is None else f"{f['value']:.3g}{f['unit']}"
        target = (
            ""
            if f["target"] is None
            else f"{f['op']} {f['target']:g}{f['unit'] if f['unit'] != 'x' else 'x'}"
        )
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['name']} | {value} | {target} | {met} | {f['detail']} |")
    lines += [
        "",
        "Per-core decode paths (one process per core over the same images, medians):",
        "",
        "| path | ms/image/core | images/s, all cores |",
        "|---|---|---|",
    ]
    labels = {
        "naive_stock": f"naive, stock Pillow {r.get('stock_pillow', {}).get('pil_version', '')}",
        "floor_stock": f"floor, stock Pillow {r.get('stock_pillow', {}).get('pil_version', '')}",
        "naive_simd": "naive, Pillow-SIMD"
        if build["pillow_simd"]
        else f"naive, venv PIL {build['pil_version']}",
    }
    for name, p in r["paths"].items():
        label = labels.get(name, name)
        lines.append(f"| {label} | {p['ms_per_image_per_core']:.2f} | {p['images_per_s']:.0f} |")
    job = r["job"]
    for label, run in (
        ("job, all cores (steady)", job["all_cores"]),
        ("job, 1 CPU (steady)", job["one_cpu"]),
        ("job, 2-node cluster (steady)", job["two_node_cluster"]),
    ):
        if run:
            rate = run["marginal_images_per_s"]
            cpus = 1 if "1 CPU" in label else cores
            lines.append(f"| {label} | {1000 * cpus / rate:.2f} | {rate:.0f} |")
    lines += [
        "",
        "Generated by `make bench` (`python -m bench.run`); raw numbers in `bench/results.json`.",
        "",
    ]
    return "\n".join(lines)
