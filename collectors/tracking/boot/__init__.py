"""The start-up hook ``diag wrap`` puts first on the wrapped process's ``PYTHONPATH`` (see ``sitecustomize``)."""
