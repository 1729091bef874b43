"""fedlab_nb on Flower: the ServerApp and ClientApp come from `fedlab_nb.flower.to_flower`."""
