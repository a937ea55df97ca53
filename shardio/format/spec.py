"""The shardio dataset format, versions 3 to 6: the spec, and the constants it fixes (names, versions, limits).

A dataset is a directory::

    DIR/
      manifest.json            the root of the current generation (replaced last, atomically: the commit)
      manifests/GEN.json       the root of every kept generation, immutable, GEN zero-padded to 10 digits
      index/SHA256.npz         index segments (format versions 3 and 4): immutable, create-only, named by the
                               sha256 of their bytes; a root names the ones it is made of, in order
      shards/NAME.npy          pixels: N×H×W×3 uint8, C order, a .npy v1.0 file with a 128-byte header
                               (``encoding: raw``, the default; H×W: its bucket's h×w in a bucketed
                               dataset, "Buckets")
      shards/NAME.jpg.npy      or, in a dataset whose config says ``encoding: jpeg``: the N images as JPEGs,
                               an offsets array and their bytes (``shardio.format.jpeg_shard``)
      shards/NAME.yuv.npy      or, ``encoding: yuv420``: the N images' Y, Cb, Cr planes, N×S uint8, a .npy
                               v1.0 file with a 128-byte header (``shardio.format.yuv_shard``)
      shards/NAME.jsonl        metadata: N lines, one JSON object per sample, in the same order
      shards/NAME.OUT.npy      in a dataset with model outputs (format version 6): output OUT of the N
                               samples, N×(its shape) of its dtype, a .npy v1.0 file with a 128-byte header
                               ("Model outputs")
      reports/RUN.json         each run's report (the run history, ``shardio.format.run_report``); not needed to read
      .lock                    held (flock) by a running job; on object storage a lease object (JSON:
                               holder, host, pid, expires), present only while a run holds it
      .run-RUN.json            written under the lock before a run's first task, removed when its tasks
                               have all ended (JSON: run, started): one left behind names a run killed
                               or stopped early, whose promoted but uncommitted shard files the next
                               run (or ``preprocess gc``) finds by comparing every file in ``shards/``
                               with the index; without one, a run does not read ``shards/`` (a run
                               whose own task failed or was retried compares it at its end)

One module writes, renames and removes files here, in the order this spec requires: ``shardio.write.directory``.

What a run of a dataset writes, so what its cleaning may remove (nothing else is ever deleted: a user's notes
or a stray tar kept inside the folder are reported, by name, not removed). In ``shards/``: a shard's files,
named ``STEM-NNNNN.npy``, ``STEM-NNNNN.jpg.npy``, ``STEM-NNNNN.yuv.npy``, ``STEM-NNNNN.jsonl`` and an output's
``STEM-NNNNN.OUT.npy`` (``OUT`` an ASCII identifier; ``STEM`` a
non-empty name not starting with a dot, ``NNNNN`` the shard's number within its input, five or more
decimal digits: ``is_shard_file_name``), and staged files, whose names start with ``.tmp-``. Beside
them: ``.tmp-`` files in the directory, ``reports/`` and ``manifests/``, ``manifests/GEN.json`` roots,
``index/HEX64.npz`` segments and ``.run-RUN.json`` marks. A file of ``shards/`` with a shard's name
that no kept generation lists nor retires is a killed run's leftover (the cleaning after a run's mark
removes it); any other file there is not the dataset's.

Pixels (``.npy``). The standard numpy format, so ``np.load(path, mmap_mode="r")`` reads a shard with numpy
alone and a batch is a slice of a memory map. The header is always exactly ``HEADER_BYTES`` = 128 bytes
(magic ``\\x93NUMPY``, version 1.0, little-endian uint16 header length 118, a Python-literal dict
``{'descr': '|u1', 'fortran_order': False, 'shape': (N, H, W, 3), }`` padded with spaces, ``\\n``), so a
shard's exact size is ``128 + N*H*W*3`` bytes: a truncated shard is caught by one ``stat``. uint8 has no
byte order; the layout is NHWC (channels last, RGB), what image code and ``torch`` channels-last expect.

Pixel encodings (the config's ``encoding``; version 3). ``raw`` (the default, and every dataset written
before version 3: a config without the key is raw) stores the pixels as above. ``jpeg`` stores each H×W
image once as a baseline JPEG, by libjpeg-turbo with the config's ``quality`` (1-100) and ``subsampling``
(``"4:4:4"`` or ``"4:2:0"``), in the layout of ``shardio.format.jpeg_shard``: same shape, samples per
shard, ``.jsonl``, manifest entry (``bytes`` and the checksum are the whole ``.jpg.npy``'s), generations
and commit protocol; about 24 KB an image at 256² and the defaults (quality 90, 4:4:4) against 196 KB raw,
with a median PSNR of about 42 dB against the raw pixels on photos (``python -m bench.jpeg_quality``). A reader
decodes a batch back to the same uint8 N×H×W×3 (``shardio.read.jpeg_pixels``), on the CPU or, on CUDA, on the GPU
(``shardio.train.device_decode``; docs/reader.md, "JPEG datasets"); the pixels are the raw ones within the
JPEG error (docs/guides/compact-shards.md), not equal.

``yuv420`` (format version 5) stores each H×W image as full-range BT.601 Y at full size and Cb, Cr at half
size in each direction (odd sides rounded up), the JFIF equations JPEG uses: ``H*W + 2*ceil(H/2)*ceil(W/2)``
bytes a sample, 1.5 a pixel (98 KB at 256² against 196 KB raw), every sample the same size, so a shard
is a fixed-shape ``.npy`` (N×S uint8, ``shards/NAME.yuv.npy``) whose exact size one ``stat`` checks and a
batch is a slice of its map, as for ``raw``. Chroma is the mean of each 2×2 block; a reader repeats each
chroma sample over its block (nearest upsampling) and converts back to the same uint8 N×H×W×3 RGB as a raw
dataset's batches (``shardio.read.yuv_pixels``: natively, numpy where the extension is not built, the same
bytes; on a GPU ``DeviceLoader`` copies the planes, half the bytes, and converts there). The layout, the
equations, the rounding and why nearest: ``shardio.format.yuv_shard``. The pixels are the raw ones within
the subsampling's error (median PSNR about 46 dB on photos, ``python -m bench.yuv_reader``), not equal.
Same ``.jsonl``, manifest entry, generations, commit protocol, buckets and verify as ``raw``.
Any other ``encoding`` is refused.

Buckets (format version 4; a dataset whose config says ``mode: bucket``). Each image keeps its aspect
ratio: it is resized to the bucket (an ``h×w`` shape near the pixel budget ``height × width``) nearest its
own aspect ratio, and every shard holds one bucket's shape, so a batch read from one shard is still a
slice of one memory map. What changes against version 3:

- The root (below) has ``buckets``: the resolved list ``[[h, w], ...]`` (each side a whole number
  1..``MAX_SIDE``, at most ``MAX_BUCKETS`` entries), the same list as the config's ``buckets`` (so
  ``config_hash`` fixes it: a rerun cannot change it). A bucket's id is its index in that list.
  ``shape`` stays ``[H, W, 3]``: the pixel budget, not the shape of any sample.
- Every index segment of the dataset has the member ``shard_bucket`` (uint16, one per shard row): the
  bucket of each shard. A segment of a single-shape dataset has no such member (every shard is of
  ``shape``: bucket 0 of the one-entry list ``[[H, W]]``).
- A shard holds ``N`` images of its bucket's ``h×w``: a raw ``.npy`` is ``N×h×w×3`` (its header says so;
  exact size ``128 + N*h*w*3``); a JPEG shard's images are ``h×w`` JPEGs. ``.jsonl`` lines are as in
  version 3 (``width``/``height``: the source image's size). Shard files are named as in version 3,
  ``STEM-NNNNN``, the number counting an input's shards across all its buckets.
- Every encoding (``raw``, ``jpeg``, ``yuv420``) takes buckets: a yuv420 shard's samples are each
  ``h*w + 2*ceil(h/2)*ceil(w/2)`` bytes of its bucket's shape.
- Everything else is version 3's: commits, compaction (which carries ``shard_bucket`` row for row),
  generations, retention, object storage, verify. An input replaced by a rerun is a new entry, its shards
  in whatever buckets its samples now fall.

**The version rule**: a root is ``format_version`` 6 exactly when its config has a non-empty ``models``
("Model outputs"); else 5 exactly when its config says ``encoding: yuv420``; else 4 exactly when its config
says ``mode: bucket``; else 3. ``buckets`` is present exactly when the
config says ``mode: bucket`` (version 4, or 5 bucketed), equal to the config's, and then each of its
segments has ``shard_bucket``, every value below ``len(buckets)``; a root without ``buckets`` has no
segment with ``shard_bucket``. A root breaking the rule, or a ``shard_bucket`` out of range, is refused
naming the file (edited or forged). A single-shape raw or JPEG dataset stays version 3, byte for byte
what it was before buckets, so older readers keep reading it; a bucketed raw or JPEG dataset stays
version 4. Older readers refuse version 4 (a reader of version 3 would map each shard at the root's one
shape) and version 5 (a reader of versions 3 and 4 would map a yuv420 shard's planes as raw pixels).
Buckets and yuv420 are never written in a version 1/2 one-document manifest.

Model outputs (format version 6; a dataset whose config has ``models``: an output name to the model that
makes it, ``preprocess.models.model_config``). Each output is a fixed-shape tensor per sample, computed once by
the job from exactly what a reader yields (an image model: the stored pixels of the sample's bucket, uint8
[h, w, 3], decoded back for ``jpeg`` and ``yuv420``; a text model: the caption), stored in the dtype its model
returned, so a batch of it is a slice of a memory map as raw pixels are. What changes against version 5:

- The config keeps ``models`` (each output's ``fn``, ``input`` and ``dtype``: what it stores; ``batch_size``,
  ``device`` and ``replicas`` say how a run runs it and are not kept), so
  ``config_hash`` fixes the list; a config without models stores no ``models`` key (its bytes and hash are what
  they were before outputs existed).
- The root has ``outputs`` (after ``classes``): a list, in the config's order, of ``{name, input, dtype,
  descr, shapes, identity}``: ``name`` the output's (an ASCII identifier, the batch key it is read under),
  ``input`` ``"image"`` or ``"text"``, ``dtype`` the torch dtype's name (``float16``, ``bfloat16``, ``float32``,
  ``float64``, ``uint8``, ``int8``, ``int16``, ``int32``, ``int64``, ``bool``) and ``descr`` the ``.npy`` descr
  its files store (little-endian: ``<f2``, ``<f4``...; ``bfloat16``, which numpy lacks, as its raw bits
  ``<u2``), ``shapes`` one entry per bucket (one in a single-shape dataset): the per-sample shape, a list of
  1..``MAX_OUTPUT_DIMS`` (8) ints >= 1, or null for a bucket no committed sample has reached yet (a text
  model's is one shape, in every bucket a sample reached), and ``identity`` the model's ``{function, weights,
  version}`` (``preprocess.models.identity``: ``weights`` an ``xxh3_128:HEX`` digest of a torch module's
  parameters and buffers, ``version`` a string the model carries; null where it has none). The names and their
  order are the dataset's for its life; a run records a bucket's shape with its first sample.
- A shard ``shards/STEM-NNNNN.npy`` (or ``.jpg.npy``, ``.yuv.npy``) has, for each output ``OUT``, the file
  ``shards/STEM-NNNNN.OUT.npy``: the shard's N samples' outputs, in its order, a .npy v1.0 file of shape
  (N, *shape of the shard's bucket), C order, that descr, with a header of exactly ``HEADER_BYTES`` (so its
  exact size is ``128 + N * prod(shape) * itemsize``: one ``stat`` checks it). It belongs to its shard: written,
  listed, retired, cleaned and collected with it (a shard's files are its pixels, its ``.jsonl`` and its
  outputs').
- Every index segment of the dataset has the member ``output_digest``: uint8 (n, K, 16), the xxh3_128
  digest of each shard's K output files, in the root's ``outputs`` order (K = ``len(outputs)``); a segment of
  removals alone may have none. Compaction carries it row for row. A root without ``outputs`` has no segment
  with the member.
- ``encoding: none`` (a dataset with outputs only): no pixels are kept, the outputs are the dataset (a latent
  is a tenth of a raw picture, or less). Each shard's pixel file ``shards/STEM-NNNNN.npy`` is then its header
  alone, a .npy of shape (N, 0, 0, 3) uint8, exactly ``HEADER_BYTES``, so a shard still has its three kinds of
  files and every check above holds unchanged; a reader's batches and samples have no ``image``. A root whose
  config says ``encoding: none`` without ``models`` is refused (edited or forged).
- Everything else is version 5's (and, for a single-shape raw dataset, version 3's): pixels, ``.jsonl``,
  commits, generations, retention, object storage, buckets.

Metadata (``.jsonl``). UTF-8, one object per line, line i describes image i of the ``.npy``:
``key`` (str, the sample key as in its source tar), ``tar`` (str, the input it came from: a tar, or any
other kind of input, the field's name kept), ``member`` (str, the image's member name in that tar; a
Parquet input's ``row N``, N counted from 0 over the file), ``width``/``height`` (int, the original image size before
any resizing, after EXIF orientation), ``txt`` (str or null, the caption), ``cls`` (an int64 or null, the label: a
reader refuses any other value, a string, ``1.7``, ``true``, ``10**30``, naming the line),
``json`` (object or null, the sample's ``.json``), and, in datasets written with ``mode: pad`` only, ``box``
(``[x0, y0, x1, y1]``, ints, end-exclusive, ``0 <= x0 < x1 <= W``, ``0 <= y0 < y1 <= H``: the output pixels
that hold the picture, the rest being the config's ``fill``; crops drawn inside it never show the
letterbox). A line without ``box`` means the whole H×W image. No pickle anywhere.

``crop`` (``[top, left]``, ints, ``0 <= top < height``, ``0 <= left < width``), on every line of a dataset
written with ``mode: center_crop`` or ``mode: bucket``: the source pixels the centre crop cut above and to
the left of the stored picture, in the coordinates of ``width``/``height`` (the upright source, before any
resizing or draft decode), halves rounded up. With ``width``/``height`` it is Stable Diffusion XL's size and
crop conditioning (``original_size``, ``crops_coords_top_left``). An optional field: every reader takes a
line's fields by name and ignores the others, so, as the field rule (below) has it for the root, the version
stays as it was and older readers read on without it. ``pad`` and ``stretch`` cut nothing and
write no ``crop``: their crop is (0, 0), SDXL's "not cropped". A line without ``crop`` in a dataset of any
other mode was written before the field existed: its crop is unknown, (-1, -1) to a reader
(``line_crop_default``).

Names (``key``, ``member``, and the ``key`` of a report's failures) are always valid UTF-8. Tar member
names are bytes; a name that is valid UTF-8 is stored as is, except that each backslash is doubled
(``\\\\``); each byte that is not part of valid UTF-8 is stored as ``\\xNN`` (two lower-case hex digits),
so ``b"caf\\xe9.jpg"`` (Latin-1) is stored as ``caf\\xe9.jpg``. ``unescape_name`` gives back the exact bytes.

Index (format version 3, ``shardio.format.index``). Version 2 rewrote one JSON document listing every
shard and input at every commit (145 MB at 410k shards, every 2 s of a run, and a full copy per kept
generation). Version 3 splits it into a small root and immutable segments, so a commit writes what it adds:

- A **segment** (``index/SHA256.npz``) is an uncompressed zip of ``.npy`` members (``np.savez`` layout,
  written with fixed timestamps so the same content gives the same bytes and name), read with
  ``np.load(path, allow_pickle=False)``: numpy and the standard library, no pickle. One object per
  segment (object storage prefers few objects to a folder of ``.npy`` files), and its members are
  stored, not deflated, so a reader may memory-map one by its offset. Members (m inputs, n shards, r
  removals; every integer little-endian; a string table ``X`` is ``X_offsets`` int64 (k+1) into
  ``X_blob`` uint8, UTF-8, entry i = ``blob[offsets[i]:offsets[i+1]]``):

  ======================  ===================================================================================
  ``input_name``          string table (m), sorted by UTF-8 bytes, unique: input path or URL
  ``input_etag``          string table (m): an object's ETag when read, "" for a local file
  ``input_size``          int64 (m); ``input_mtime_ns`` int64 (m); ``input_samples`` int64 (m);
                          ``input_failed`` int64 (m): as version 2's ``inputs`` entries
  ``input_listed``        uint8 (m): 1 for a committed input; 0 for a name that only groups shards (a
                          manifest whose shards name an input it does not list, as bench datasets do)
  ``input_first_shard``   int64 (m+1): input i owns shard rows ``[first[i], first[i+1])``
  ``shard_path``          string table (n): ``shards/NAME.npy``, sorted by path within its input
  ``shard_meta_path``     string table (n): ``shards/NAME.jsonl``
  ``shard_samples``       int64 (n); ``shard_bytes`` int64 (n); ``shard_meta_bytes`` int64 (n)
  ``shard_algorithm``     uint8 (n): 0 ``xxh3_128``, 1 ``sha256`` (shards of version 1 datasets)
  ``shard_digest``        uint8 (n, W): the ``.npy``'s digest bytes (hex = ``bytes.hex()``); W is 16 when
                          every row is xxh3_128, else 32 (an xxh3_128 row then uses the first 16)
  ``shard_meta_digest``   uint8 (n, W): the ``.jsonl``'s, likewise
  ``shard_bucket``        uint16 (n): the bucket id of each shard (format version 4 only: "Buckets")
  ``output_digest``       uint8 (n, K, 16): each shard's output files' xxh3_128 digests (version 6:
                          "Model outputs")
  ``removed``             string table (r): inputs this segment removes from the segments before it
  ``fence``               uint8 (16), optional: the dataset's fence as ASCII ("Fencing names"), in every
                          segment of a dataset whose root has one; a reader ignores it
  ======================  ===================================================================================

- The **root** (``manifest.json``, and ``manifests/GEN.json`` a copy per generation) is JSON: ``format``,
  ``format_version`` 3 (4 for a bucketed dataset, which adds ``buckets`` after ``shape``: "Buckets"; 5 for
  ``encoding: yuv420``, with ``buckets`` when bucketed: "The version rule"; 6 with model outputs, which adds
  ``outputs``: "Model outputs"),
  ``layout``, ``dtype``, ``shape``, ``config``, ``config_hash``, ``versions``,
  ``updated``, ``generation``, ``retired`` as in version 2, ``run`` (the committing run's id; absent outside
  a run: "Retention"), the totals (``samples``, ``shard_count``,
  ``input_count``, ``bytes``, ``meta_bytes``, ``failed``: ``shardio info`` reads nothing else), and
  ``segments``: a list, oldest first, of ``{path, bytes, shards, inputs, removed, samples}`` (``path``
  ``index/SHA256.npz``; ``bytes`` its size, checked when read; its name is its sha256, checked too), and
  ``dataset`` (below).
- **Identity** (``dataset``; an optional field, so by the field rule below the version stays 3):
  32 lower-case hex digits, a random UUID4 drawn by the dataset's first commit and copied by every later
  commit into its root, so every generation names it, and a copy or a move of the directory (which copies
  the roots) keeps it. A resume state names the identity of the generation it was taken on and is refused
  by a dataset of another identity, naming both (``shardio.read.resume``); a state of the same dataset
  resumes wherever the directory now lives. A root without the field (written before it) and a version
  1/2 manifest have the identity ``config:`` + the first 32 hex digits of ``config_hash``: fixed for the
  dataset's life (a run refuses another config) and the same in a copy, it tells apart datasets of
  different configs (the same tars as ``raw`` and as ``jpeg``), not two of one config; the next commit
  to such a dataset draws a random identity, which its later generations carry (its earlier roots keep
  theirs, so a state taken on one of them still resumes there). Restoring such an earlier root as the
  current one (``verify --repair``) and committing again draws a new identity: states taken since the
  first one are then refused, by the message that names both. Anything but 32 lower-case hex digits is
  refused at load.
- **The field rule**: a reader ignores a root field it does not know (every shardio reading version 3
  does), so a field a reader may ignore, such as ``dataset``, is added without a new ``format_version``;
  a field or a meaning a reader must not ignore takes the next version, which older readers refuse.
- **Meaning**: fold the segments in order; a segment's ``removed`` names leave the inputs of the
  segments before it, then each of its inputs replaces any earlier input of that name (a changed tar is
  a new entry, not an edit). The dataset's shards are the live inputs' shards, in **dataset order**:
  inputs sorted by name, each input's shards by path (version 2's order: ``(input, path)``). Each shard
  file (``.npy`` and ``.jsonl``) belongs to one live input, once: an index whose live inputs list a file
  twice (under two inputs, in one segment or two, or twice under one) is refused at load, as a version
  1/2 manifest is (its samples would be read twice); the check hashes the paths from the segments'
  blobs and sorts the hashes (~0.04 s per 300k shards).
- **A commit** writes one segment with the inputs it adds or replaces (with their shards) and the names
  it drops, create-only (a content name that exists already holds these bytes), then the root, as
  version 2 published its manifest: ``manifests/GEN.json`` created once, then ``manifest.json`` replaced
  (``If-Match`` on object storage). Killed before the root, the new segment is named by no root and the
  next run's leftover cleaning removes it.
- **Compaction** (in the commit, tiered as in an LSM tree): a segment's tier is
  ``floor(log8(max(1, rows)))``, rows = its shards + inputs + removals; when the newest ``COMPACT_FANOUT``
  (8) segments share a tier they are merged into one (removals applied, replaced entries dropped,
  removals still needed by older segments kept; none when the merge starts at the first segment), and
  again while that holds. So a root names O(8 log8 N) segments and an entry is rewritten once per
  tier, O(log8 N) times. The merged segment is written before the root that names it: a killed
  compaction is a killed commit.
- **Generations**: a generation is a root; a kept root keeps the segments it names. A segment is
  deleted once no kept root (nor ``manifest.json``) names it, under the lock, by the leftover cleaning
  and retention (``shardio.write.retention``), and only a file named ``index/HEX64.npz``.
- **Upgrade**: a version 1 or 2 ``manifest.json`` is read as before; the first commit to it writes one
  segment holding everything it lists, and a version 3 root over it (an ordinary commit: killed before
  the root, the old manifest is still the dataset). Its older generation files stay readable.
- **Checking a shard by hand**: ``python -m shardio.format.manifests DIR | xxh128sum -c`` (run in DIR) prints
  ``DIGEST  shards/NAME.npy`` lines for every xxh3_128 shard (``--sha256`` for the older ones, for
  ``sha256sum -c``). Without shardio::

      import numpy as np
      z = np.load("index/SEG.npz", allow_pickle=False)
      o, b = z["shard_path_offsets"], z["shard_path_blob"].tobytes()
      for i in range(len(o) - 1):
          print(z["shard_digest"][i][:16].hex(), b[o[i]:o[i + 1]].decode())   # a shard of a segment

Manifest (``manifest.json`` of format versions 1 and 2, still read). A JSON object:

=================  ======================================================================================
``format``         ``"shardio"``
``format_version`` ``3`` when the config's ``encoding`` is ``jpeg`` (a reader of versions 1 and 2 would
                   take its shards for raw ones, so it must refuse them); else ``2`` when any entry is
                   ``xxh3_128``; ``1`` when every entry is ``sha256`` (as written before xxh3_128
                   checksums, and kept so when such a dataset's manifest is rewritten, e.g. by ``gc``, so
                   an older reader still reads it): a raw dataset's manifest is the same bytes as before
                   version 3; a reader reads versions 1 to 5, refuses any other and says which it reads
``layout``         ``"NHWC"``; ``dtype``: ``"uint8"``; ``shape``: ``[H, W, 3]`` of every sample, each side
                   0..``MAX_SIDE`` (8192, the writer's bound; a reader refuses a root that says more)
``samples``        total number of samples (sum over ``shards``)
``config``         the resolved config that wrote the pixels; ``config_hash``: sha256 of its canonical JSON
``versions``       libraries that produced the pixels (shardio, Pillow / Pillow-SIMD, libjpeg-turbo, numpy)
``shards``         list, in dataset order, of ``{path, meta_path, samples, bytes, ALG, meta_bytes,
                   meta_ALG, input}``; paths are relative to DIR; ``ALG``/``meta_ALG`` are the hex
                   digests of the whole ``.npy`` (or ``.jpg.npy``)/``.jsonl`` by the checksum algorithm ALG that the key
                   names: ``xxh3_128`` (every shard written now) or ``sha256`` (shards written before;
                   a dataset may mix both after an incremental run); exactly one ALG per entry; each
                   file is listed once (a duplicate is refused at load: its samples would be read twice)
``inputs``         object: input path or URL -> ``{size, mtime_ns, samples, failed, shards: [shard paths]}``,
                   plus ``etag`` for an object-storage input (its ETag when it was read; absent for a
                   local file): what incremental runs compare against (a file: size + mtime_ns; an
                   object: size + etag); a shard belongs to one input and is listed there once
``updated``        ISO-8601 time of the last commit
``generation``     int, 1 for the first commit, +1 per commit; 0 (or absent) in a manifest written before
                   generations existed; anything but a JSON integer >= 0 is refused (in a root too)
``retired``        list of ``{path, generation, since}``: shard files (``.npy`` and ``.jsonl`` each) that
                   generation ``generation`` (committed at ``since``, ISO-8601) stopped listing, kept on
                   disk for the readers of older generations until the retention below collects them
=================  ======================================================================================

Checksums (``shardio.store.checksum``). xxh3_128 is a non-cryptographic checksum: it catches corruption and
truncation, which is what the manifest's digests are for, not tampering (who can rewrite a shard can rewrite
the manifest). It costs ~0.003 ms per 196 KB image against 0.11 ms for sha256, and a stranger checks a
shard with a standard tool: ``xxh128sum shards/NAME.npy`` (package ``xxhash``) prints the manifest's
``xxh3_128``; ``sha256sum`` prints an older entry's ``sha256``.

Every path in a manifest (``shards``, ``inputs[*].shards``, ``retired``) is ``shards/NAME``: relative, one
level, no ``..``, no leading dot. ``load_manifest`` refuses any other (a manifest is data, and a path such
as ``../victim.npy`` must never make a reader read, or a job delete, a file outside the dataset).

Generations. A commit writes ``manifests/GEN.json`` (the same bytes as the new ``manifest.json``), then
replaces ``manifest.json`` (the commit point); ``manifest.json`` stays the entry point of readers and of
strangers. A generation file newer than ``manifest.json`` is a killed commit: the next run removes it
(when ``manifest.json`` itself is missing, as after a killed first commit, the newest generation is restored).
``load_manifest(DIR, generation=G)`` / ``open_dataset(DIR, generation=G)`` reopen a kept generation,
so a trainer resumes on the exact snapshot it started with (``DatasetSnapshot.generation``). A
``manifest.json`` that is corrupt or missing while generations exist is restored from the newest valid
one by ``preprocess verify DIR --repair`` and by the next ``preprocess run``.

Retention (``shardio.write.retention``). Files a commit stops listing are not deleted at that commit: a trainer
that opened the previous generation memory-maps its shards lazily, through a whole epoch (hours). A
generation G is *kept* while it is one of the newest ``retain_generations`` (default 3) or while its
successor G+1 was committed less than ``retain_hours`` (default 24) ago: a nightly run never removes
what a day-long epoch started the night before still reads. Where G+1's root was collected already (a
passing one), the next generation still on storage stands for it: committed no earlier than G+1, its
time is an upper bound, so G is never let go sooner, and never kept for want of a time. A retired file is deleted, and
a generation file removed, once no kept generation lists it; only under the output lock, at the end of a run or by
``preprocess gc DIR``, and only files the manifest's ``retired`` list names.

A run commits every few seconds, so most generations are *passing* ones: a version 3 root names the run
that committed it (``run``: the run id of its report; absent for a commit outside a run), and a
generation is passing when the next generation was committed by the same run. Beyond the newest
``retain_generations``, a passing generation's root is kept only when it is the newest generation
committed in its ``retain_passing_minutes`` (default 10) bucket of wall time (UTC, ``floor(commit time /
bucket)``), so a run leaves at most one root per bucket, whatever the number of its commits, and the
segments only collected roots named go with them (each kept root keeps its own segments: a run's 3,000
roots and their pre-compaction segments were 8x the index). A run's result (its last generation) and
a commit outside a run are kept as above. Retired shard files follow the time rule alone (``retain_hours``): a trainer
that opened a passing generation keeps reading its files (and, locally, its index, memory-mapped, and handed to
DataLoader workers, ``spawn`` ones included, as open descriptors, not paths) for its whole epoch; only reopening a
collected passing generation by number (a resume state taken on it) is refused, naming the kept ones. A reader that
read ``manifest.json`` and then found a segment it names gone, while ``manifest.json`` now names a newer generation
(the run's retention collected the root it read: a slow link), reads the newest root instead (up to 5 times; then it
says the dataset kept moving, not that it is damaged); a segment the current root names and lacks is damage (``verify
--repair``). A reader whose generation retention collected since it opened it (``gc --retain-hours 0`` does at once,
by design) is told so when a file it needs is gone, not to repair a healthy dataset. ``retain_passing_minutes`` 0
keeps every generation (the rule before version 3's index).

Writes are atomic (temp file, fsync, rename): a shard becomes visible only when the manifest that lists it
is renamed into place, so a reader always sees a consistent snapshot and a killed job leaves nothing
half-visible. Every file is created with mode ``0o666`` less the umask (``0644`` under umask 022), so a
trainer running as another user than the job can read the dataset.

On object storage (``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX`` or ``az://CONTAINER/PREFIX`` is the
directory: the same keys under the prefix, no folder objects) the layout and every file are the same bytes;
the commit protocol maps onto conditional writes (``shardio.store.object_store``): a shard is an object uploaded whole
at its final key, invisible until a manifest lists it; ``manifests/GEN.json`` is created only if absent;
``manifest.json`` is replaced only if its version (ETag; GCS: generation) is still the one the run read (created only
if absent for a new dataset), so two writers can never overwrite each other's commit. The one-writer lock is a lease
(``.lock``, ``shardio.store.lease``); whatever happens to it (its holder paused past its expiry, cut off from the
store, its clock jumping), no committed generation names a file that is not there: a holder commits or
deletes only while it can prove its lease on a monotonic clock, and a run that takes a lease over
publishes the committed root again as the next generation (over the ETag it read) before it deletes
anything, so the previous holder's commit is refused by the store however late it comes
(``shardio.write.directory.writing``, "Fencing").

Fencing names (``fence``, an optional root field: the version stays 3). A previous holder's *deletions*
cannot be fenced by the store (S3 has no conditional DELETE): a holder paused between the check of its
lease and its request, or whose request the network held back, may delete a file by name after another
run took the lease over. A shard's name is deterministic (its input's fingerprint and its number), so a
rerun of an input the previous holder had staged would write the very names that holder may still delete.
So a run that takes a lease over by its expiry (its holder may live; a holder proven dead on this host,
as after a ``kill -9``, sends nothing more) writes ``fence``, its lease token (16 lower-case hex digits),
into its fencing root (or its first commit, where nothing was committed), every later commit copies it,
and every shard file written from then on carries it: ``STEM`` is ``NAME-FINGERPRINT-FENCE`` instead of
``NAME-FINGERPRINT``. Every index segment written from then on, merged ones included, holds the member
``fence`` (its 16 ASCII bytes), so its bytes, hence its content name, are the fence's own: a segment the
previous holder wrote (a drop of the same input, say) and deletes late is never one the new holder's
roots name. No name the previous holder knew is written again, so its late deletions remove only its own
files; a later takeover draws a new fence. A root without ``fence`` (none was ever
needed) names shards as before, so a rerun after a ``kill -9`` writes the same bytes under the same names.
Anything but 16 lower-case hex digits is refused at load.

Classes (``classes``, an optional root field: the version stays 3, or 4). A dataset whose config says
``folder_classes: true`` keeps its class table in its root: a list of class names, each a non-empty
string, no name twice; a class's id, the ``cls`` of its samples (whose ``json`` carries ``"class": NAME``),
is its index in the list. The table belongs to the dataset, not to an input: one name has one id across
every input, drop and rerun. A run reads the committed table, appends the names its folder inputs bring
that it lacks (sorted, so a run killed and rerun appends the same names in the same order, and writes the
same bytes), gives its tasks the whole table, and every commit copies it into its root, as it copies
``dataset``. A name is never removed nor renumbered, even when no sample of it remains (an input dropped
or pruned): a later input of that class gets its old id, and a model trained on an earlier generation keeps
its outputs' meaning. Readers: ``ShardDataset.classes``, ``shardio info``. A root without the field has no
table (every dataset of another config, and one whose folder inputs were committed before the table
existed: their ids are each folder's own sorted order; the next run that commits enters the names of those
it skips first, sorted, so a dataset of one such folder keeps its ids). Anything but a list of distinct
non-empty strings is refused at load, naming the root.

The code. Each idea of this spec has its module beside this one, and ``shardio.format`` re-exports them
all (``from shardio.format import Manifest``): a raw shard's ``.npy`` header (``shardio.format.raw_shard``),
which ``format_version`` a dataset has (``shardio.format.version_rule``, the one place it is decided),
bucket lists (``shardio.format.buckets``), a root's fields (``shardio.format.root_fields``), what a stored
config implies (``shardio.format.dataset_config``), a yuv420 shard's layout and colour conversion
(``shardio.format.yuv_shard``), model outputs (``shardio.format.model_outputs``), names and safe paths
(``shardio.format.names``), manifest entries (``shardio.format.entries``), and the dataset as objects with its
version 1/2 document (``shardio.format.dataset_manifest``).
"""

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "BUCKET_FORMAT_VERSION",
    "READ_VERSIONS",
    "LEGACY_VERSIONS",
    "INDEX_VERSIONS",
    "BUCKET_MODE",
    "JPEG_FORMAT_VERSION",
    "YUV420_FORMAT_VERSION",
    "OUTPUTS_FORMAT_VERSION",
    "RAW",
    "JPEG",
    "YUV420",
    "NONE",
    "ENCODINGS",
    "SUBSAMPLINGS",
    "HEADER_BYTES",
    "MAX_SIDE",
    "MAX_BUCKETS",
    "MANIFEST_NAME",
    "SHARDS_DIR",
    "REPORTS_DIR",
    "MANIFESTS_DIR",
    "INDEX_DIR",
    "UNCROPPED_MODES",
]

FORMAT_NAME = "shardio"
# The version a single-shape dataset (raw or JPEG) is written as: its root is the same bytes as before
# buckets existed, so older readers keep reading it.
FORMAT_VERSION = 3
# A bucketed dataset (config ``mode: bucket``): its shards have several shapes, which a reader of version 3
# would map at the root's one shape, so it must refuse them (spec, "Buckets").
BUCKET_FORMAT_VERSION = 4
# Version 1 manifests (before xxh3_128 checksums) are read and checked as before: they list sha256 only;
# version 2 is the one-document manifest before the index (both upgraded to 3 by the next commit).
READ_VERSIONS = (1, 2, 3, 4, 5, 6)
LEGACY_VERSIONS = (1, 2)
# The versions whose root names index segments (``shardio.format.index``).
INDEX_VERSIONS = (3, 4, 5, 6)
# The config ``mode`` of a bucketed dataset; its ``buckets`` is the resolved list of [h, w].
BUCKET_MODE = "bucket"
# A JPEG dataset (config ``encoding: jpeg``) exists only from version 3 on: a reader of versions 1 and 2
# would map its shards as raw pixels, so a one-document (1/2) manifest that says jpeg is refused.
JPEG_FORMAT_VERSION = 3
# A yuv420 dataset (config ``encoding: yuv420``, single-shape or bucketed): its shards hold planes a reader of
# version 3 or 4 would map as raw pixels, so it must refuse them (spec, "The version rule").
YUV420_FORMAT_VERSION = 5
# A dataset with model outputs (a non-empty ``models`` in its config): a reader of versions 3 to 5 would read its
# pixels and miss the outputs a trainer asks for, so it must refuse it (spec, "Model outputs").
OUTPUTS_FORMAT_VERSION = 6
RAW, JPEG, YUV420, NONE = "raw", "jpeg", "yuv420", "none"
ENCODINGS = (RAW, JPEG, YUV420, NONE)
SUBSAMPLINGS = ("4:4:4", "4:2:0")
HEADER_BYTES = 128
# The largest height or width a dataset may have: the writer's config refuses more (preprocess.config),
# and a reader refuses a root that says more before sizing anything by it.
MAX_SIDE = 8192
# The most buckets a dataset may have: ids are stored as uint16 (``shard_bucket``).
MAX_BUCKETS = 65536
MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
REPORTS_DIR = "reports"
MANIFESTS_DIR = "manifests"
INDEX_DIR = "index"
# A .npy v1.0 file's first 8 bytes (spec, "Pixels"); a JPEG shard's header starts with them too.
NPY_MAGIC = b"\x93NUMPY\x01\x00"
# The resize modes that keep the whole picture: their lines have no ``crop`` (see "Metadata" above).
UNCROPPED_MODES = ("pad", "stretch")
