module anneal.dev/reward-example

go 1.24
