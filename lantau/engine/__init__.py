"""Engine core (schedule -> run -> update) and the in-process engine with detokenization."""
