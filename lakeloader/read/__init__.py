"""Read: catalog views of committed chunks, verified chunk files, token spans."""
