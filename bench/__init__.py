"""lastgood's benchmark against its peers and its limits (`make bench`). Not a timed test."""
