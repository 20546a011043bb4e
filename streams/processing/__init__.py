"""Pure async processing steps: no Faust here."""
