"""detect"""
