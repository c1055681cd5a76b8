"""Reading, preprocessing and augmenting KiTS19 volumes."""
