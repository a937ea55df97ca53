"""The one compiled part: ``preprocess._jpeg_region`` (libjpeg-turbo region decode; metadata lives in
pyproject.toml). Optional: where it cannot be built (no compiler or no libjpeg headers, e.g. a training
image that installs only the reader) the install goes on and ``preprocess`` decodes with Pillow."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("preprocess._jpeg_region", ["preprocess/_jpeg_region.c"], libraries=["jpeg"],
                  extra_compile_args=["-O2"], optional=True),
    ],
)
