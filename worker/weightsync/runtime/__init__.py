"""What every rank process shares, whatever its role: its connection to the job (joining,
failure reports, lingering until the end), its health endpoint, the loop that receives versions
between generations, stopping child processes, and the fault hooks the tests and benchmarks use."""
