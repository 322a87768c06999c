"""Stage 2: passes over AOTAutograd's joint forward+backward graph (see `autosp.passes`)."""
