"""One module per weight-sync transport: each registers its Transport (name, placements, delta
support, config checks, build) with megarl/checkpoint_engine/config.py when imported. The
registry finds them by file name, so adding a transport is adding a file here."""
