"""The documentation's generated pages and the checks that keep the written ones honest (``make docs``)."""
