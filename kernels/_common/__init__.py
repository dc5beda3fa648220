"""What the families share that is not Triton: the gfx950 geometry (``geometry``) and the
models' scaffold and rescale decision (``models``)."""
