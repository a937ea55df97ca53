"""The compiled parts (metadata lives in pyproject.toml), all optional: where they cannot be built (no
compiler or no libjpeg headers, e.g. a training image that installs only the reader) the install goes on.
``preprocess.image._jpeg_region`` (libjpeg-turbo region decode; without it ``preprocess`` decodes with Pillow);
``shardio.read._jpeg_batch`` (batched JPEG decode for ``encoding: jpeg`` datasets;
without it raw datasets read as before and opening a JPEG dataset says what to install)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("preprocess.image._jpeg_region", ["preprocess/image/_jpeg_region.c"], libraries=["jpeg"],
                  extra_compile_args=["-O2"], optional=True),
        Extension("shardio.read._jpeg_batch", ["shardio/read/_jpeg_batch.c"], libraries=["jpeg"],
                  extra_compile_args=["-O2"], extra_link_args=["-pthread"], optional=True),
        Extension("shardio.read._gather", ["shardio/read/_gather.c"], extra_compile_args=["-O2"],
                  extra_link_args=["-pthread"], optional=True),
    ],
)
