"""lightning_rec: train large recommendation models with Lightning (`Trainer(strategy="rec")`)."""
