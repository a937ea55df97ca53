"""One image: draft-decode, resize, encode, and the checks and limits around them."""
