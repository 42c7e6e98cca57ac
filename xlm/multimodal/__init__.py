"""Images in: decoding and checking images, each family's processor (pixels and the
placeholder tokens they expand to), and the features a request carries to the engine."""
