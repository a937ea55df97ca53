"""The GPU check's results as table rows (figure, value, goal): one reading of ``gpu_check.json`` for the
check's own table (``gpu_check.md``); the figures page (docs/reference/figures.md) reads the same JSON."""

from __future__ import annotations

from typing import Any


def _get(results: dict[str, Any], *keys: str) -> Any:
    value: Any = results
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _rate(row: Any) -> str:
    if isinstance(row, dict) and "samples_per_s" in row:
        return f"{row['samples_per_s']:,.0f} samples/s, {row['cpu_cores_busy']} CPU cores busy"
    return str(row) if row is not None else "not measured"


def rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    env = results.get("env", {})
    if isinstance(env, dict):
        out.append(("machine", f"{env.get('card', 'no GPU')}, driver {env.get('driver', '-')}, torch "
                               f"{env.get('torch')} (CUDA {env.get('cuda')}), {env.get('cpu_count')} cores, "
                               f"{env.get('date')}", ""))
        out.append(("decode library chosen", f"{str(env.get('chosen_decoder'))[:120]} (torchcodec: "
                                             f"{str(env.get('torchcodec'))[:160]}; torchvision: "
                                             f"{str(env.get('torchvision'))[:80]})", "torchcodec >= 0.17"))
    tests = results.get("cuda_tests")
    if isinstance(tests, dict):
        out.append(("CUDA tests", f"exit {tests.get('exit')}, {tests.get('counts')}", "all pass"))
    for row in _get(results, "stream_safety", "rows") or []:
        value = (f"{row['corrupted']} of {row['trials']} corrupted" if "trials" in row
                 else row.get("skipped", "?"))
        if row.get("max_abs_vs_cpu_decode") is not None:
            value += f"; pixels within {row['max_abs_vs_cpu_decode']:.0f} levels of the CPU decode"
        goal = "0" if "barrier on" in row["decoder"] else "> 0 shows the harness bites"
        out.append((f"stream safety, {row.get('jpeg', '')}: {row['decoder']}", value, goal))
    decode = results.get("decode")
    if isinstance(decode, dict):
        for name in ("torchcodec", "torchvision"):
            if isinstance(decode.get(name), dict):
                out.append((f"decode 256² JPEG, {name} {decode[name]['version']} via DeviceDecoder",
                            _rate(decode[name]["device_decoder"]), ">= 20k/s, 1 core"))
                out.append((f"decode 256² JPEG, {name} raw", _rate(decode[name]["raw"]), ""))
            elif name in decode:
                out.append((f"decode 256² JPEG, {name}", str(decode[name]), ""))
        if "device_loader_jpeg" in decode:
            out.append(("DeviceLoader, JPEG dataset, no model", _rate(decode["device_loader_jpeg"]), ""))
        # a dry run of an older check measured the CPU reader alone
        reader = decode if "samples_per_s" in decode else decode.get("cpu_reader_all_cores")
        out.append(("CPU reader, JPEG dataset, every core", _rate(reader), ""))
        if isinstance(decode.get("ceiling"), dict):
            out += _ceiling_rows(decode["ceiling"])
    h2d = results.get("h2d")
    if isinstance(h2d, dict) and "ratio" in h2d:
        out.append(("H2D: DeviceLoader raw batches / pinned copy",
                    f"{h2d['device_loader_GBps']} / {h2d['pinned_GBps']} GB/s = {h2d['ratio']}", ">= 0.8"))
        if "copy_stage_GBps" in h2d:
            out.append(("H2D: the copies of the loader's pinned batches alone (GPU-timed) / pinned copy",
                        f"{h2d['copy_stage_GBps']} GB/s = {h2d['copy_stage_ratio']}", ">= 0.8"))
        if "host_assembly_GBps" in h2d:
            out.append(("host side alone: shuffled batches gathered into pinned memory",
                        f"{h2d['host_assembly_GBps']} GB/s, {h2d['host_assembly_cpu_cores_busy']} cores busy", ""))
    gather = results.get("gather")
    if isinstance(gather, dict) and "rows" in gather:
        for threads, row in gather["rows"].items():
            default = " (the default)" if str(threads) == str(gather.get("default_threads")) else ""
            if "ratio" in row:
                out.append((f"DeviceLoader raw batches, {threads} gather thread(s){default} / pinned copy",
                            f"{row['device_loader_GBps']} / {gather['pinned_GBps']} GB/s = {row['ratio']}, "
                            f"{row['loader_cpu_cores_busy']} cores busy", ">= 0.5"))
            out.append((f"host side alone, {threads} gather thread(s){default}",
                        f"{row['host_GBps']} GB/s, {row['host_cpu_cores_busy']} cores busy", ""))
    out += _yuv420_rows(results.get("yuv420"))
    out += _models_rows(results.get("models"))
    steps = (("train_step", "ResNet-50 bf16", "< 1%"), ("train_step_resnet18", "ResNet-18 bf16", "< 2%"))
    for part, model, goal in steps:
        train = results.get(part)
        if not (isinstance(train, dict) and "synthetic_step_ms" in train):
            continue
        model = train.get("model", model)
        out.append((f"{model} step, batch on the device", f"{train['synthetic_step_ms']} ms", ""))
        for name, row in train.items():
            if isinstance(row, dict) and "wait_share" in row:
                steady = (f"; {100 * row['steady_wait_share']:.2f}% without the epoch's first batch "
                          f"(waits {row['epoch_start_waits_ms']} ms)" if "steady_wait_share" in row else "")
                out.append((f"{model} step from the {name} dataset: time waiting for data",
                            f"{100 * row['wait_share']:.2f}% (step {row['step_ms']} ms, "
                            f"{row['samples_per_s']:,.0f} samples/s){steady}", goal))
    out += _lightning_rows(results.get("lightning_wait"))
    store = results.get("object_store")
    if isinstance(store, dict):
        for name in ("raw", "jpeg"):
            if isinstance(store.get(name), dict) and "ratio" in store[name]:
                row = store[name]
                threads = f", {row['download_threads']} download threads" if "download_threads" in row else ""
                out.append((f"S3 reader cold epoch / raw GET, {name}",
                            f"{row['cold_MBps']} / {row['raw_get_MBps']} MB/s = {row['ratio']}{threads}", ">= 0.7"))
        if "job" in store:
            out.append(("S3 job / local job", str(store["job"]), ">= 0.85"))
        if "skipped" in store:
            out.append(("object storage", str(store["skipped"]), ""))
    for name, value in results.items():
        if isinstance(value, dict) and "error" in value:
            out.append((f"{name} failed", value["error"][:300], ""))
    return out


def _ceiling_rows(ceiling: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The decoder alone per host thread count, per size and library; DeviceLoader against it; the backends."""
    out: list[tuple[str, str, str]] = []
    if "error" in ceiling:
        return [("decode ceiling failed", str(ceiling["error"])[:300], "")]
    for label, size in ceiling.get("sizes", {}).items():
        for name, row in size.items():
            if isinstance(row, dict) and "by_threads" in row:
                rates = ", ".join(f"{threads}: {rate['samples_per_s']:,.0f}" if "samples_per_s" in rate
                                  else f"{threads}: {rate.get('error', '?')[:80]}"
                                  for threads, rate in row["by_threads"].items())
                best = f" (best {row['best_threads']} threads)" if "best_threads" in row else ""
                out.append((f"decode ceiling {label} JPEG, {name}, samples/s by host threads", rates + best, ""))
            elif isinstance(row, str) and row.startswith("not available"):
                out.append((f"decode ceiling {label} JPEG, {name}", row[:160], ""))
        loader = size.get("device_loader")
        if isinstance(loader, dict) and "device_loader_over_ceiling" in size:
            out.append((f"DeviceLoader {label} JPEG / the decoder's ceiling",
                        f"{loader['samples_per_s']:,.0f} samples/s = {size['device_loader_over_ceiling']}", ">= 0.8"))
    for name, choice in ceiling.get("backend_choice", {}).items():
        if choice.get("exposed"):
            value = f"{choice['parameter']}= (default {choice['default']}; values {choice['values'] or 'not listed'})"
        elif choice.get("exposed") is False:
            value = "not exposed: decode_jpeg takes no backend (nvJPEG picks it)"
        else:
            value = f"not known: {str(choice.get('why'))[:120]}"
        out.append((f"decode backend choice (hardware / CUDA), {name}", value, ""))
    return out


def _models_rows(models: Any) -> list[tuple[str, str, str]]:
    """The job with a model against the model alone (``bench.gpu_models``)."""
    if not isinstance(models, dict):
        return []
    if "error" in models:
        return [("the job with a model / the model alone", f"error: {str(models['error'])[:200]}", ">= 0.8")]
    return [(f"the job with a model / the model alone, {models['model'].split(':')[-1]} at {models['side']}² "
             f"({models['device']})",
             f"{models['job_samples_per_s']:,.0f} / {models['model_alone_samples_per_s']:,.0f} samples/s = "
             f"{models['ratio']} ({models['samples']} samples; job start-up {models['job_startup_s']} s)",
             f">= {models['goal']}")]


def _yuv420_rows(yuv: Any) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    if not isinstance(yuv, dict):
        return out
    for way in ("normalised", "uint8"):
        row = yuv.get(way)
        if isinstance(row, dict) and "ratio" in row:
            out.append((f"yuv420 / raw samples/s to the device, DeviceLoader, {way} ({yuv.get('device')})",
                        f"{row['yuv420_samples_per_s']:,.0f} / {row['raw_samples_per_s']:,.0f} = {row['ratio']}",
                        ">= 1.8"))
    quality = yuv.get("quality")
    if isinstance(quality, dict) and "psnr_db" in quality:
        db = quality["psnr_db"]
        out.append(("yuv420 against raw, PSNR on the photos",
                    f"median {db['median']} dB, p5 {db['p5']}, min {db['min']}, max abs error "
                    f"{quality['max_abs_error']} ({quality['images']} images, {quality['bytes_per_image']:.0f} bytes "
                    f"against {quality['raw_bytes_per_image']})", ">= 38 dB median"))
    return out


def _lightning_rows(wait: Any) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    if not isinstance(wait, dict):
        return out
    model = wait.get("model", "ResNet-50 bf16")
    for name, row in wait.items():
        if isinstance(row, dict) and "data_wait_share" in row:
            out.append((f"Lightning Trainer, {model} from the {name} dataset: time waiting for data",
                        f"{100 * row['data_wait_share']:.2f}% (step {row['step_ms']} ms, "
                        f"{row['samples_per_s']:,.0f} samples/s; between steps "
                        f"{100 * row['between_steps_share']:.2f}%)",
                        "< 0.5%"))
    return out
